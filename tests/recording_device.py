"""A test helper: the connector's device layer (``kvbridge.bindings.core.Device``) for host
memory, recording each call with the thread that made it, so that tests can assert the
order a GPU needs (a mark on the engine's thread before the mover's wait for it, the wait
before the copy, the device bound on every thread that moves pages) on a machine with no
GPU. Copies are the host's; with ``fail`` a copy raises, with ``fail_wait`` a wait does
(where a sticky CUDA error shows first: the event's synchronize), and ``sticky`` says
that the failure lost the device's context."""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import numpy as np

from kvbridge.bindings.core import Copier, HostCopier, PageLayout


@dataclass(frozen=True)
class Call:
    op: str
    """``mark``, ``wait``, ``bind``, ``gather`` or ``scatter``."""
    thread: str
    mark: int | None = None


class RecordingDevice:
    def __init__(
        self, *, fail: bool = False, fail_wait: bool = False, sticky: bool = False
    ) -> None:
        self.calls: list[Call] = []
        self.fail = fail
        self.fail_wait = fail_wait
        self.sticky = sticky
        self._marks = itertools.count()
        self._lock = threading.Lock()

    def mark(self) -> object | None:
        mark = next(self._marks)
        self._record("mark", mark)
        return mark

    def wait(self, mark: object | None) -> None:
        self._record("wait", mark if isinstance(mark, int) else None)
        if self.fail_wait:
            raise RuntimeError("CUDA error: device-side assert triggered")

    def bind(self) -> None:
        self._record("bind")

    def copier(self) -> Copier:
        return _RecordingCopier(self)

    def lost(self, error: BaseException) -> bool:
        return self.sticky

    def ops(self, thread: str | None = None) -> list[tuple[str, int | None]]:
        """The calls (op, mark) in order, of one thread or all."""
        with self._lock:
            return [(c.op, c.mark) for c in self.calls if thread in (None, c.thread)]

    def threads(self, op: str) -> set[str]:
        with self._lock:
            return {c.thread for c in self.calls if c.op == op}

    def _record(self, op: str, mark: int | None = None) -> None:
        with self._lock:
            self.calls.append(Call(op, threading.current_thread().name, mark))


class _RecordingCopier:
    def __init__(self, device: RecordingDevice) -> None:
        self._device = device
        self._host = HostCopier()

    def allocate(self, nbytes: int) -> np.ndarray:
        return self._host.allocate(nbytes)

    def gather(self, memory: PageLayout, offsets: np.ndarray, rows: np.ndarray) -> None:
        self._copy("gather")
        self._host.gather(memory, offsets, rows)

    def scatter(self, memory: PageLayout, offsets: np.ndarray, rows: np.ndarray) -> None:
        self._copy("scatter")
        self._host.scatter(memory, offsets, rows)

    def _copy(self, op: str) -> None:
        self._device._record(op)
        if self._device.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
