"""Turning caller buffers into per-block arrays, and copying between host and device.

A block array is a 1-D ``uint8`` view: a ``numpy.ndarray`` for host memory or a
``cupy.ndarray`` for device memory. Views never copy; a buffer that cannot be viewed as
contiguous bytes is rejected with :class:`InvalidBlock` instead of being copied silently.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from ..transfer import is_device
from ._errors import InvalidBlock

BlockArray = Any
"""``numpy.ndarray`` (host) or ``cupy.ndarray`` (device), 1-D ``uint8``, ``block_bytes`` long."""


@functools.cache
def cupy_module() -> ModuleType | None:
    """Return the ``cupy`` module when it imports and sees a GPU, else ``None``."""
    try:
        import cupy  # noqa: PLC0415 - optional dependency

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
    except Exception:  # ImportError, or a CUDA driver/runtime error
        return None
    module: ModuleType = cupy
    return module


def as_array(obj: object, *, writable: bool) -> BlockArray:
    """View ``obj`` as flat bytes without copying; raise :class:`InvalidBlock` if impossible."""
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise InvalidBlock("block buffers must be C-contiguous")
        if writable and not obj.flags.writeable:
            raise InvalidBlock("output buffer is read-only")
        return obj.reshape(-1).view(np.uint8)
    if is_device(obj):
        cupy = cupy_module()
        if cupy is None:
            raise InvalidBlock("a GPU buffer was given but cupy is not available")
        arr = cupy.asarray(obj)
        if not arr.flags.c_contiguous:
            raise InvalidBlock("block buffers must be C-contiguous")
        return arr.reshape(-1).view(cupy.uint8)
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidBlock(f"{type(obj).__name__} does not support the buffer protocol") from None
    if not view.c_contiguous:
        raise InvalidBlock("block buffers must be C-contiguous")
    if writable and view.readonly:
        raise InvalidBlock(f"output buffer ({type(obj).__name__}) is read-only")
    return np.frombuffer(view, dtype=np.uint8)


def split_blocks(
    blocks: object, count: int, block_bytes: int, *, writable: bool
) -> tuple[list[BlockArray], Positions]:
    """Return ``count`` block views of ``blocks`` and their positions (for ``copy_blocks``).

    ``blocks`` is either one contiguous buffer of exactly ``count * block_bytes`` bytes or a
    list/tuple of ``count`` buffers of ``block_bytes`` bytes each.
    """
    if isinstance(blocks, (list, tuple)):
        if len(blocks) != count:
            raise InvalidBlock(f"{count} key(s) but {len(blocks)} block buffer(s)")
        arrays = [as_array(b, writable=writable) for b in blocks]
        for i, arr in enumerate(arrays):
            if arr.size != block_bytes:
                raise InvalidBlock(f"block {i} is {arr.size} bytes, expected {block_bytes}")
        return arrays, None
    flat = as_array(blocks, writable=writable)
    if flat.size != count * block_bytes:
        raise InvalidBlock(
            f"buffer is {flat.size} bytes, expected {count} x {block_bytes} = {count * block_bytes}"
        )
    views = [flat[i * block_bytes : (i + 1) * block_bytes] for i in range(count)]
    return views, range(count)


def copy_into(dst: BlockArray, src: BlockArray) -> None:
    """Copy one block array into another, across host and device as needed."""
    if isinstance(dst, np.ndarray):
        if isinstance(src, np.ndarray):
            np.copyto(dst, src)
        else:
            src.get(out=dst)
    elif isinstance(src, np.ndarray):
        dst.set(src)
    else:
        dst[...] = src


Positions = Sequence[int | None] | None
"""Where each block sits in the one buffer its sequence came from (a flat caller buffer or
a slab), counted in blocks; ``None`` where unknown. Used only to find adjacent runs."""


def copy_blocks(
    dsts: Sequence[BlockArray],
    srcs: Sequence[BlockArray],
    dst_at: Positions = None,
    src_at: Positions = None,
) -> None:
    """Copy ``srcs[i]`` into ``dsts[i]`` for every ``i``, merging adjacent blocks.

    Where consecutive blocks sit at consecutive positions of the same host buffer on both
    sides, the run is copied with one ``numpy.copyto``: one large copy runs at memory
    bandwidth (non-temporal stores), while 1 MiB pieces run about 40% slower on the
    development machine (11.6 against 7.2 GB/s; see benches/README.md). Where one side is
    slots of one device slab and the other host memory, the batch is one gather or scatter
    on the device and one copy across PCIe (:func:`_device_batch`), not one per block.
    """
    if _device_batch(dsts, srcs, dst_at, src_at):
        return
    count = len(dsts)
    start = 0
    while start < count:
        end = start + 1
        if (
            dst_at is not None
            and src_at is not None
            and dst_at[start] is not None
            and src_at[start] is not None
            and isinstance(dsts[start], np.ndarray)
            and isinstance(srcs[start], np.ndarray)
        ):
            dst_base, src_base = dsts[start].base, srcs[start].base
            while (
                end < count
                and dst_at[end] == dst_at[end - 1] + 1  # type: ignore[operator]
                and src_at[end] == src_at[end - 1] + 1  # type: ignore[operator]
                and dsts[end].base is dst_base
                and srcs[end].base is src_base
            ):
                end += 1
        if end - start > 1:
            length = (end - start) * dsts[start].nbytes
            np.copyto(_extend(dsts[start], length), _extend(srcs[start], length))
        else:
            copy_into(dsts[start], srcs[start])
        start = end


def _device_batch(
    dsts: Sequence[BlockArray], srcs: Sequence[BlockArray], dst_at: Positions, src_at: Positions
) -> bool:
    """Copy a batch between slots of one device slab (their slot numbers in ``*_at``) and
    host blocks in one gather (device to host: a get from the device tier) or one scatter
    (host to device: a put into it); False, copying nothing, for any other batch."""
    if len(dsts) < 2:
        return False
    source = _slab_rows(srcs, src_at)
    if source is not None and all(isinstance(d, np.ndarray) for d in dsts):
        rows, slots = source
        out = _host_run(dsts, dst_at)
        packed = rows[slots]  # one gather on the device
        if out is not None:
            packed.get(out=out)  # one copy across PCIe, into the caller's buffer
        else:
            for dst, row in zip(dsts, packed.get(), strict=True):
                np.copyto(dst, row)
        return True
    target = _slab_rows(dsts, dst_at)
    if target is not None and all(isinstance(s, np.ndarray) for s in srcs):
        rows, slots = target
        host = _host_run(srcs, src_at)
        rows[slots] = _to_device(host if host is not None else np.stack(srcs))  # one scatter
        return True
    return False


def _slab_rows(arrays: Sequence[BlockArray], at: Positions) -> tuple[Any, Any] | None:
    """``(the slab as rows of a block, the blocks' row numbers on the device)`` when every
    array is a device slot of one slab whose place is known; else ``None``."""
    first = arrays[0]
    if at is None or isinstance(first, np.ndarray) or not is_device(first):
        return None
    base = first.base
    if base is None or any(a.base is not base for a in arrays) or any(p is None for p in at):
        return None
    cupy = cupy_module()
    assert cupy is not None  # a device slot exists
    rows = base.reshape(-1, first.size)
    return rows, cupy.asarray(list(at), dtype=cupy.int64)


def _host_run(arrays: Sequence[BlockArray], at: Positions) -> np.ndarray | None:
    """The blocks as one ``(count, block_bytes)`` view when they are adjacent blocks of one
    host buffer, in order; else ``None``."""
    if at is None or any(p is None for p in at) or not isinstance(arrays[0], np.ndarray):
        return None
    base = arrays[0].base
    for i in range(1, len(arrays)):
        if at[i] != at[i - 1] + 1 or arrays[i].base is not base:  # type: ignore[operator]
            return None
    size = arrays[0].size
    return _extend(arrays[0], len(arrays) * size).reshape(len(arrays), size)


def _to_device(host: np.ndarray) -> Any:
    cupy = cupy_module()
    assert cupy is not None
    return cupy.asarray(host)  # one copy across PCIe


def fill_slots(
    slab: np.ndarray,
    block_bytes: int,
    slots: Sequence[int],
    srcs: Sequence[BlockArray],
    src_at: Positions,
) -> None:
    """Copy ``srcs[i]`` into slot ``slots[i]`` of a host slab (flat bytes), one copy per
    run of blocks adjacent on both sides (``src_at``: their places in the one buffer they
    came from), without making a view per slot."""
    count = len(slots)
    if src_at is None or count < 2 or not isinstance(srcs[0], np.ndarray):
        runs = np.arange(count + 1)
    else:
        at = np.fromiter((-1 if a is None else a for a in src_at), np.int64, count)
        where = np.asarray(slots, dtype=np.int64)
        joined = (np.diff(where) == 1) & (np.diff(at) == 1) & (at[1:] >= 0) & (at[:-1] >= 0)
        runs = np.concatenate(([0], np.flatnonzero(~joined) + 1, [count]))
    for start, end in zip(runs[:-1].tolist(), runs[1:].tolist(), strict=True):
        first = slots[start] * block_bytes
        length = (end - start) * block_bytes
        source = _extend(srcs[start], length) if end - start > 1 else srcs[start]
        copy_into(slab[first : first + length], source)


def _extend(first: np.ndarray, length: int) -> np.ndarray:
    """A view of ``length`` bytes from ``first``'s start. The caller checked that the bytes
    are adjacent blocks of the buffer that ``first`` views."""
    view: np.ndarray = np.lib.stride_tricks.as_strided(
        first, shape=(length,), strides=(1,), writeable=first.flags.writeable
    )
    return view


def to_host(arr: BlockArray) -> np.ndarray:
    """Return a host array with the bytes of ``arr`` (no copy when it is already on host)."""
    if isinstance(arr, np.ndarray):
        return arr
    host: np.ndarray = arr.get()
    return host


def as_sequence(value: object, what: str) -> Sequence[Any]:
    """Accept any iterable of keys; a lone ``bytes`` is a common mistake, so say so."""
    if isinstance(value, (bytes, bytearray, str)):
        raise TypeError(f"{what} must be a sequence of keys, not a single {type(value).__name__}")
    if isinstance(value, Sequence):
        return value
    if isinstance(value, Iterable):
        return list(value)
    raise TypeError(f"{what} must be a sequence of keys, not {type(value).__name__}")
