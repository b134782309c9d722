"""A caller's buffers, registered with a client's transfer engine for one call."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ._buffers import as_array, split_blocks

if TYPE_CHECKING:
    from ._client import StoreClient

Locations = tuple[np.ndarray, np.ndarray]
"""Per key and segment (shape ``(keys, segments)``): the local region id and the offset in
it of that part of the block (a block is ``segments`` equal parts, one op each)."""


class Registration:
    """Registers a caller's buffer(s) for one call and unregisters them after it."""

    def __init__(self, client: StoreClient, blocks: object, count: int, *, writable: bool) -> None:
        bb = client.block_bytes
        self._engine = client.engine
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
