"""Where a connector's blocks live: a cache server (``kvbridge serve``, or one the engine's
worker runs for itself, ``_embedded``).

A backend answers: how many leading keys are present (``lookup``), keep these from
eviction until loaded (``pin``/``unpin``), and move pages between the engine's KV cache and
the store (``load``, ``save``): zero-copy batched ops between the registered KV cache and
the server's slots, one op per (layer, block) page.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from .._closing import Closing
from ..store import BlockKey, StoreClient
from ..transfer import Region
from ._pages import LayoutError, PagedKV


class Backend(Protocol):
    def lookup(self, keys: Sequence[BlockKey]) -> int: ...

    def pin(self, keys: Sequence[BlockKey]) -> object | None:
        """A hold on the blocks, or ``None`` when one is gone already."""

    def unpin(self, hold: object) -> None: ...

    def attach(self, kv: PagedKV) -> None:
        """The KV cache that ``load`` and ``save`` move pages of (worker side)."""

    def load(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> None:
        """Fill the blocks with the stored pages; raises when any cannot be loaded."""

    def save(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> int:
        """Store the blocks (keys already present are skipped); returns how many moved."""

    def close(self) -> None: ...


class ServerBackend(Closing):
    """Blocks in a cache server, one namespace per model layout."""

    def __init__(
        self, address: str, secret: bytes | None, namespace: bytes, block_bytes: int, timeout: float
    ) -> None:
        self._client = StoreClient(
            address, block_bytes=block_bytes, namespace=namespace, secret=secret, timeout=timeout
        )
        self._lock = threading.Lock()  # one call at a time on the client's control channel
        self._kv: PagedKV | None = None
        self._regions: list[Region] = []

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        with self._lock:
            return self._client.match_prefix(keys)

    def pin(self, keys: Sequence[BlockKey]) -> object | None:
        """One lease per request-sized chunk (a server bounds what one request pins)."""
        leases: list[int] = []
        with self._lock:
            step = self._client.request_keys
            try:
                for start in range(0, len(keys), step):
                    leases.append(self._client.pin(keys[start : start + step]))
            except BaseException as exc:
                for lease in leases:  # all or nothing
                    self._client.release(lease)
                if isinstance(exc, LookupError):  # BlockNotFound: evicted since the lookup
                    return None
                raise
        return leases or None

    def unpin(self, hold: object) -> None:
        assert isinstance(hold, list)
        with self._lock:
            for lease in hold:
                self._client.release(lease)

    def attach(self, kv: PagedKV) -> None:
        for layer, page in enumerate(kv.pages):
            if not getattr(page, "flags", {"C_CONTIGUOUS": False})["C_CONTIGUOUS"]:
                raise LayoutError(f"layer {layer}: blocks are not adjacent in memory")
        self._kv = kv
        self._regions = [self._client.register(page) for page in kv.pages]

    def load(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> None:
        offsets = self._offsets(block_ids)
        with self._lock:
            self._client.get_pages(keys, self._regions, offsets)

    def save(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> int:
        offsets = self._offsets(block_ids)
        with self._lock:
            return sum(self._client.put_pages(keys, self._regions, offsets))

    def server_stats(self) -> dict[str, Any]:
        with self._lock:
            return self._client.server_stats()

    def close(self) -> None:
        self._client.close()

    def _offsets(self, block_ids: Sequence[int]) -> np.ndarray:
        kv = self._kv
        if kv is None:
            raise LayoutError("no KV cache attached")
        ids = kv.check(block_ids)
        return np.repeat((ids * kv.page_bytes)[:, None], kv.layers, axis=1)
