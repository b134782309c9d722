"""Where a connector's blocks live: a ``kvbridge serve`` or a store in this process.

Both answer the same five questions: how many leading keys are present (``lookup``), keep
these from eviction until loaded (``pin``/``unpin``), and move pages between the engine's
KV cache and the store (``load``, ``save``). The server moves pages with zero-copy batched
ops between the registered KV cache and its slots; the local store copies them (it holds
its own memory).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from .._closing import Closing
from ..store import BlockKey, StoreClient, TieredStore
from ..transfer import Region
from ._config import ConnectorConfig
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
    """Blocks in a ``kvbridge serve``, one namespace per model layout."""

    def __init__(self, config: ConnectorConfig, namespace: bytes, block_bytes: int) -> None:
        assert config.server is not None
        self._client = StoreClient(
            config.server,
            block_bytes=block_bytes,
            namespace=namespace,
            secret=config.secret,
            timeout=config.timeout,
        )
        self._lock = threading.Lock()  # one call at a time on the client's control channel
        self._kv: PagedKV | None = None
        self._regions: list[Region] = []

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        with self._lock:
            return self._client.match_prefix(keys)

    def pin(self, keys: Sequence[BlockKey]) -> object | None:
        if not keys:
            return None
        with self._lock:
            try:
                return self._client.pin(keys)
            except LookupError:  # BlockNotFound: evicted since the lookup
                return None

    def unpin(self, hold: object) -> None:
        with self._lock:
            self._client.release(int(hold))  # type: ignore[call-overload]

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


class LocalBackend(Closing):
    """Blocks in a :class:`TieredStore` of this process (host memory, then disk)."""

    def __init__(self, config: ConnectorConfig, namespace: bytes, block_bytes: int) -> None:
        self._store = TieredStore(
            block_bytes,
            host_capacity=config.host_capacity,
            disk_path=config.disk_path,
            disk_capacity=config.disk_capacity,
            namespace=namespace,
            policy="reuse",
        )
        self._kv: PagedKV | None = None

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        return self._store.match_prefix(keys)

    def pin(self, keys: Sequence[BlockKey]) -> object | None:
        if not keys:
            return None
        try:
            return self._store.pin(keys)
        except LookupError:
            return None

    def unpin(self, hold: object) -> None:
        hold.release()  # type: ignore[attr-defined]

    def attach(self, kv: PagedKV) -> None:
        self._kv = kv

    def load(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> None:
        kv = self._attached()
        data = np.empty((len(keys), kv.block_bytes), dtype=np.uint8)
        self._store.get(keys, data)
        kv.scatter(block_ids, data)

    def save(self, keys: Sequence[BlockKey], block_ids: Sequence[int]) -> int:
        kv = self._attached()
        present = self._store.contains(keys)
        todo = [i for i, p in enumerate(present) if not p]
        if not todo:
            return 0
        data = kv.gather([block_ids[i] for i in todo])
        return sum(self._store.put([keys[i] for i in todo], data))

    @property
    def store(self) -> TieredStore:
        return self._store

    def close(self) -> None:
        self._store.close()

    def _attached(self) -> PagedKV:
        if self._kv is None:
            raise LayoutError("no KV cache attached")
        return self._kv
