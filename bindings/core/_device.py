"""The order between the engine's device work and the connector's moves of its pages.

An engine queues its forward on a stream of its own, current on its own thread only (vLLM
0.32 runs the forward on a stream it made; with async scheduling the forward of a step may
still run when the connector is called). The connector reads a save's pages and writes a
load's on other threads, or through a transport that touches the memory itself, so every
move is ordered by construction:

- on the engine's thread, :meth:`Device.mark` records where its current stream is (the
  forward that wrote a save's pages; vLLM's zeroing of a load's new blocks);
- the mark travels with the move to whichever thread runs it, which first waits for it
  (:meth:`Device.wait`) before a copy or a transport reads or writes a byte;
- every thread that moves pages selects the engine's device first, once
  (:meth:`Device.bind`): a CUDA call on another thread would otherwise make a context on
  device 0, whatever device the engine's rank uses;
- a copy that fails is that move's failure (a miss), unless the device's context is lost
  (an illegal address, a device-side assert: :meth:`Device.lost`), which no later move can
  survive: the connector turns itself off.

:class:`HostDevice` is memory on the host: nothing to order. :class:`CudaDevice` is a
CUDA device, on torch (its events and the connector's copy stream).
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Protocol

from ._pages import PageLayout
from ._staging import Copier, CudaCopier, HostCopier

__all__ = ["CudaDevice", "Device", "HostDevice", "current_cuda", "device_for", "select_cuda"]


class Device(Protocol):
    """Where the engine's pages are, and how moves of them are ordered against it."""

    def mark(self) -> object | None:
        """On the engine's thread: where its current stream is now (``None``: nothing to
        wait for)."""

    def wait(self, mark: object | None) -> None:
        """Block the calling thread until the work before ``mark`` ran."""

    def bind(self) -> None:
        """Select the engine's device on the calling thread (once per thread)."""

    def copier(self) -> Copier:
        """The copies between this memory and host staging rows."""

    def lost(self, error: BaseException) -> bool:
        """Whether ``error``, raised by a copy, left the device's context unusable."""


class HostDevice:
    """Memory on the host: copies are done when they return, nothing to wait for."""

    def mark(self) -> object | None:
        return None

    def wait(self, mark: object | None) -> None:
        return

    def bind(self) -> None:
        return

    def copier(self) -> Copier:
        return HostCopier()

    def lost(self, error: BaseException) -> bool:
        return False


class CudaDevice:
    """A CUDA device, on torch: marks are events recorded on the engine's current stream."""

    def __init__(self, device: Any) -> None:
        import torch  # noqa: PLC0415  (present wherever a GPU engine runs)

        self._torch = torch
        self._device = device
        self._bound = threading.local()
        self._copier: CudaCopier | None = None

    def mark(self) -> object | None:
        event: object = self._torch.cuda.Event(blocking=True)  # a waiter sleeps, never spins
        event.record(self._torch.cuda.current_stream(self._device))  # type: ignore[attr-defined]
        return event

    def wait(self, mark: object | None) -> None:
        if mark is not None:
            mark.synchronize()  # type: ignore[attr-defined]

    def bind(self) -> None:
        if not getattr(self._bound, "done", False):
            self._torch.cuda.set_device(self._device)
            self._bound.done = True

    def copier(self) -> Copier:
        if self._copier is None:
            self.bind()
            self._copier = CudaCopier(self._device)
        return self._copier

    def lost(self, error: BaseException) -> bool:
        """A sticky error fails every later call on the context: one more, a synchronize,
        tells it from an error of that copy alone (a bad index, memory exhausted)."""
        try:
            self._torch.cuda.synchronize(self._device)
        except Exception:  # the context itself is gone
            return True
        return False


def device_for(memory: PageLayout) -> Device:
    """The device of ``memory``: a CUDA device (torch tensors), else the host."""
    device = getattr(memory.buffers[0], "device", None)
    if getattr(device, "type", None) == "cuda":
        return CudaDevice(device)
    return HostDevice()


def current_cuda() -> int | None:
    """The CUDA device current on the calling thread where torch is loaded and CUDA in use
    (an engine's worker: its rank's device), else ``None``. The connector's own threads
    select it before they touch CUDA (a UCX worker makes its context on the device current
    on the thread that creates it: device 0 on a thread that never chose one)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.current_device())


def select_cuda(index: int | None) -> None:
    """Make CUDA device ``index`` current on the calling thread (nothing for ``None``)."""
    if index is not None:
        sys.modules["torch"].cuda.set_device(index)
