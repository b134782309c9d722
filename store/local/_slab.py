"""Slot memory: one preallocated buffer carved into fixed-size slots.

:class:`HostSlab` is a private anonymous ``mmap`` (page-aligned, in huge pages where the
kernel has them), registered with CUDA as
pinned memory when cupy and a GPU are present (host<->device copies then run at full PCIe
speed and can be asynchronous). :class:`DeviceSlab` is one ``cupy`` allocation. Both hand
out zero-copy views of slots; the slot tier on top of them is the same code.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
from typing import Literal, Protocol

import numpy as np

from .._buffers import BlockArray, cupy_module
from .._errors import TierUnavailable

PAGE_BYTES = mmap.PAGESIZE

_log = logging.getLogger("kvbridge.store")


class SlotMemory(Protocol):
    """Fixed-size slots over one buffer."""

    slots: int
    block_bytes: int

    @property
    def on_device(self) -> bool:
        """True when slots live in GPU memory."""

    def slot(self, index: int) -> BlockArray:
        """A zero-copy view of slot ``index``."""

    def close(self) -> None:
        """Release the memory (views still held elsewhere keep it alive)."""


def _anonymous(length: int) -> mmap.mmap:
    """Private anonymous memory, in transparent huge pages where the kernel has them
    (``MADV_HUGEPAGE``). A peer's kernel copy into or out of a slot (UCX ``cma``:
    ``process_vm_writev``/``readv``) pins each page it touches: 32 KiB pages moved at
    4.1-4.4 GB/s into private huge pages, 2.8-3.0 GB/s into the shared 4 KiB pages this
    slab was before (``benches/README.md``, issue 36)."""
    memory = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    if advice is not None:
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages
            memory.madvise(advice)
    return memory


class HostSlab:
    """``slots * block_bytes`` bytes of page-aligned host memory.

    ``pin``: ``"auto"`` pins through cupy when a GPU is present, ``True`` requires it,
    ``False`` never pins. ``pinned`` says what happened. ``prefault`` maps every page up
    front (a write to each, without holding the GIL): a cache server wants that, because
    a remote write into a never-touched slot otherwise pays a page fault per 4 KiB (4 MiB
    writes into fresh slots took 3.7 ms against 1.7 ms into touched ones).
    """

    def __init__(
        self,
        slots: int,
        block_bytes: int,
        *,
        pin: bool | Literal["auto"] = "auto",
        prefault: bool = False,
    ):
        if slots < 0 or block_bytes <= 0:
            raise ValueError(f"bad slab geometry: {slots} slots of {block_bytes} bytes")
        self.slots = slots
        self.block_bytes = block_bytes
        self._mmap: mmap.mmap | None = _anonymous(max(slots * block_bytes, 1))
        self.array: np.ndarray = np.frombuffer(self._mmap, dtype=np.uint8)[: slots * block_bytes]
        if prefault:
            # A write to each page, by numpy, which lets other threads run meanwhile
            # (MAP_POPULATE and madvise hold the GIL: a server stalled 0.2 s per 256 MiB).
            self.array[::PAGE_BYTES] = 0
        self.pinned = False
        if pin is not False and slots:
            self.pinned = self._pin(required=pin is True)

    def _pin(self, *, required: bool) -> bool:
        """Page-lock the slab for the GPU's DMA. Pinning all of a large host tier can fail
        (the locked-memory limit, the machine's memory): required, that is
        :class:`TierUnavailable`; else the slab stays unpinned (copies to a GPU then go
        through the driver's own bounce buffers), said once."""
        cupy = cupy_module()
        if cupy is None:
            if required:
                raise TierUnavailable("pinned host memory needs cupy and a GPU")
            return False
        try:
            cupy.cuda.runtime.hostRegister(self.array.ctypes.data, self.array.nbytes, 0)
        except Exception as exc:  # cupy's CUDARuntimeError, whatever the cause
            if required:
                raise TierUnavailable(f"pinning {self.array.nbytes} bytes failed: {exc}") from exc
            _log.warning("host memory of %d bytes left unpinned: %s", self.array.nbytes, exc)
            return False
        return True

    @property
    def on_device(self) -> bool:
        return False

    @property
    def address(self) -> int:
        """Address of slot 0 (page-aligned)."""
        return int(self.array.ctypes.data)

    def slot(self, index: int) -> np.ndarray:
        start = index * self.block_bytes
        return self.array[start : start + self.block_bytes]

    def close(self) -> None:
        if self._mmap is None:
            return
        if self.pinned:
            cupy = cupy_module()
            assert cupy is not None
            cupy.cuda.runtime.hostUnregister(self.array.ctypes.data)
            self.pinned = False
        self.array = np.empty(0, dtype=np.uint8)
        # A caller still holding a view keeps the mapping alive until it drops the view.
        with contextlib.suppress(BufferError):
            self._mmap.close()
        self._mmap = None


class DeviceSlab:
    """``slots * block_bytes`` bytes of GPU memory on ``device_id`` (needs cupy)."""

    def __init__(self, slots: int, block_bytes: int, *, device_id: int = 0):
        cupy = cupy_module()
        if cupy is None:
            raise TierUnavailable("the device tier needs cupy and a GPU: pip install kvbridge[gpu]")
        self.slots = slots
        self.block_bytes = block_bytes
        self.device_id = device_id
        with cupy.cuda.Device(device_id):
            self.array = cupy.empty(max(slots * block_bytes, 1), dtype=cupy.uint8)

    @property
    def on_device(self) -> bool:
        return True

    def slot(self, index: int) -> BlockArray:
        start = index * self.block_bytes
        return self.array[start : start + self.block_bytes]

    def close(self) -> None:
        self.array = None
