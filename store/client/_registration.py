"""Where a call's blocks are in the caller's memory: regions registered once and offsets
in them, checked, or a caller's buffers registered with the client's engine for one call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ...transfer import Region, TransferEngine
from .._buffers import as_array, split_blocks
from .._errors import InvalidBlock

Locations = tuple[np.ndarray, np.ndarray]
"""Per key and segment (shape ``(keys, segments)``): the local region id and the offset in
it of that part of the block (a block is ``segments`` equal parts, one op each)."""


class Placed(Protocol):
    """A registered buffer as the page checks see it (a ``Region``, a cluster's region)."""

    @property
    def id(self) -> int: ...

    @property
    def length(self) -> int: ...


class Registration:
    """Registers a caller's buffer(s) for one call and unregisters them after it."""

    def __init__(
        self,
        engine: TransferEngine,
        block_bytes: int,
        blocks: object,
        count: int,
        *,
        writable: bool,
    ) -> None:
        bb = block_bytes
        self._engine = engine
        views, positions = split_blocks(blocks, count, bb, writable=writable)  # validates
        if positions is None:  # one buffer per block
            arrays = views
            offsets = np.zeros(count, dtype=np.uint64)
        else:  # one buffer for all: registered once
            arrays = [as_array(blocks, writable=writable)]
            offsets = np.arange(count, dtype=np.uint64) * np.uint64(bb)
        # Only this client's own transfers touch the buffers: no peer may read or write them.
        self._regions = [self._engine.register(a, access="none") for a in arrays]
        ids = [r.id for r in self._regions]
        regions = np.array(ids if len(ids) == count else ids * count, dtype=np.uint64)
        self.where: Locations = (regions[:count, None], offsets[:, None])

    def __enter__(self) -> Locations:
        return self.where

    def __exit__(self, *exc: object) -> None:
        for region in self._regions:
            self._engine.unregister(region)


def one_per_block(
    region: Region, offsets: Sequence[int], count: int, block_bytes: int
) -> Locations:
    """Block ``i`` whole at ``offsets[i]`` in ``region``."""
    at = _whole_offsets(offsets)
    if at.shape != (count,):
        raise InvalidBlock(f"{count} key(s) but {at.size} offset(s)")
    return pages_of_blocks([region], at[:, None], count, block_bytes)  # one page of itself


def pages_of_blocks(
    regions: Sequence[Placed], offsets: np.ndarray, count: int, block_bytes: int
) -> Locations:
    """Block ``i`` as ``len(regions)`` equal pages, page ``s`` at ``offsets[i, s]`` in
    ``regions[s]``; raises :class:`InvalidBlock` for a page outside its region."""
    segments = len(regions)
    if segments == 0 or block_bytes % segments:
        raise InvalidBlock(f"{block_bytes}-byte blocks cannot be {segments} equal pages")
    part = block_bytes // segments
    at = _whole_offsets(offsets)
    if at.shape != (count, segments):
        raise InvalidBlock(f"{count} key(s) x {segments} page(s) but offsets of {at.shape}")
    room = np.array([r.length for r in regions], dtype=np.int64) - part  # last page start
    if (at < 0).any() or (at > room).any():  # no sum: an offset near 2**63 cannot wrap
        raise InvalidBlock("an offset puts a block or page outside its region")
    ids = np.array([r.id for r in regions], dtype=np.uint64)
    return np.broadcast_to(ids, (count, segments)), at.astype(np.uint64)


def _whole_offsets(offsets: object) -> np.ndarray:
    """``offsets`` as int64, or :class:`InvalidBlock`: whole numbers only (a float is not
    truncated, a value past int64 does not wrap around)."""
    try:
        given = np.asarray(offsets)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidBlock(f"offsets must be whole numbers: {exc}") from None
    if given.size and given.dtype.kind not in "iu":
        raise InvalidBlock(f"offsets must be whole numbers, not {given.dtype}")
    if given.dtype.kind == "u" and given.size and int(given.max()) > np.iinfo(np.int64).max:
        raise InvalidBlock("an offset puts a block or page outside its region")
    return given.astype(np.int64)
