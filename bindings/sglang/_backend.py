"""kvbridge as an SGLang HiCache storage backend (sglang 0.5.23, ``HiCacheStorage``).

Load it with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvbridge",
        "module_path": "kvbridge.bindings.sglang", "class_name": "KVBridgeHiCache",
        "interface_v1": 1, "server": "127.0.0.1:7400", "secret_file": "/etc/kvbridge/secret"}'

``interface_v1`` selects the zero-copy interface (``batch_get_v1``/``batch_set_v1``: bytes
move between SGLang's host KV pool and the server's slots, no staging copy); without it
SGLang uses the copying one (``get``/``set`` on flat page tensors). Without ``server`` the
blocks live in a cache server inside each rank's process (``host_capacity``, optional
``disk_path``). Settings: :class:`kvbridge.bindings.ConnectorConfig`; ``timeout`` defaults
to 5 s here. What it decided and why: ``docs/SGLANG.md``.

Every model's pools come through SGLang 0.5.23's v2 registration too (``kv`` for a
plain model; a hybrid model's Mamba state and SWA side pools besides): ``_hybrid`` keeps
each pool's pages in a namespace of its own and answers ``batch_exists_v2``,
``batch_get_v2`` and ``batch_set_v2``.

Faults stay local: a store that is down, slow or refuses makes a call a miss (``False``,
``None``, 0 hits) and a warning, never an exception into SGLang's cache controller.
Malformed arguments (host indices that are not whole pages of the pool, a tensor of the
wrong size, a pool never registered) raise :class:`~kvbridge.bindings.LayoutError` and
move nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    PoolTransfer,
    PoolTransferResult,
)

from ...store import ConfigError
from ..core._core import ConnectorCore
from ..core._pages import LayoutError
from ._config import backend_config, identity
from ._hybrid import KV, StoredPool, close_pools, hit_query, open_side_pool, registered
from ._pool import HostPages, check_page_bytes, flat_bytes

__all__ = ["KVBridgeHiCache"]

_log = logging.getLogger("kvbridge.bindings")

_CONNECTIONS = 3
"""SGLang looks up, loads and saves on three threads: none waits for another's call."""


class KVBridgeHiCache(HiCacheStorage):  # type: ignore[misc]
    """An SGLang HiCache L3 backend whose pages live in kvbridge: one page, one block."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        """SGLang's dynamic loader calls ``cls(storage_config, kwargs)``. Settings are
        checked here (:class:`ConfigError`); the store is opened when SGLang registers its
        host pool, which says what a page's bytes are."""
        self.storage_config = storage_config
        self.config, self.zero_copy = backend_config(storage_config)
        self._pools: dict[str, StoredPool] = {}
        """SGLang's host pools by name: ``kv`` (the anchor), then any side pools."""
        self._warned = False

    @property
    def _core(self) -> ConnectorCore | None:
        """The KV pool's core (None until SGLang registered its host pool)."""
        kv = self._pools.get(KV)
        return None if kv is None else kv.core

    # -- set-up -----------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pages = HostPages(mem_pool_host)
        if self.zero_copy:
            block_bytes = pages.block_bytes
        else:  # SGLang's flat page: the bytes of its get_data_page
            block_bytes = int(mem_pool_host.get_dummy_flat_data_page().nbytes)
        check_page_bytes(KV, block_bytes)
        path = "segments" if self.zero_copy else "flat"
        ident = identity(
            self.storage_config, mem_pool_host, block_bytes, path, self.config.namespace
        )
        core = ConnectorCore(self.config, ident, connections=_CONNECTIONS)
        try:
            if self.config.server is None:
                core.host()
            if self.zero_copy:
                core.attach(pages)
        except BaseException:
            core.close()
            raise
        kv = StoredPool(KV, mem_pool_host, core, pages if self.zero_copy else None)
        old, self._pools = self._pools, {KV: kv}
        close_pools(old)
        _log.info(
            "kvbridge HiCache backend: namespace %s, %d-byte pages (%s interface)",
            core.namespace.decode(),
            block_bytes,
            "zero-copy" if self.zero_copy else "copying",
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang 0.5.23 registers every pool of its host pool group here, after the
        anchor: ``kv`` (the anchor itself: nothing to do), and a hybrid model's side pools,
        each opened in a namespace of its own. A pool kvbridge cannot take is a
        :class:`ConfigError` or :class:`LayoutError` (SGLang fails at start, saying so),
        and closes the backend: SGLang keeps a backend whose runtime attach failed at
        this step, and its later calls are misses."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        kv = self._pools.get(KV)
        if kv is None:
            raise ConfigError(
                f"kvbridge: SGLang registered host pool {name!r} before its anchor pool"
            )
        try:
            if name == KV:
                if host_pool is not kv.pool:
                    raise ConfigError(
                        "kvbridge: SGLang's kv host pool is not the anchor pool it registered "
                        f"first ({type(host_pool).__name__}, {type(kv.pool).__name__})"
                    )
                return
            side = open_side_pool(
                name,
                host_pool,
                self.storage_config,
                self.config,
                kv.core.identity,
                zero_copy=self.zero_copy,
                connections=_CONNECTIONS,
            )
        except BaseException:
            self.close()
            raise
        old = self._pools.get(name)
        self._pools[name] = side
        if old is not None:
            old.close()
        _log.info(
            "kvbridge HiCache backend: side pool %s, namespace %s, %d-byte pages (%s)",
            name,
            side.core.namespace.decode(),
            side.core.identity.block_bytes,
            "zero-copy" if side.zero_copy else "flat pages",
        )

    # -- lookups ----------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages the store holds."""
        core = self._ready()
        if core is None or not keys:
            return 0
        return core.lookup(core.named(keys))

    # -- the zero-copy interface ----------------------------------------------------------

    def batch_get_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Fill the pages at ``host_indices`` (``page_size`` slots per key); ``True`` for
        the leading pages that were loaded."""
        core = self._ready(zero_copy=True)
        if core is None or not keys:
            return [False] * len(keys)
        loaded = core.load_leading(core.named(keys), host_indices)
        return [i < loaded for i in range(len(keys))]

    def batch_set_v1(
        self, keys: list[str], host_indices: Any, extra_info: Any = None
    ) -> list[bool]:
        """Store the pages at ``host_indices``; pages the store holds already are not sent."""
        core = self._ready(zero_copy=True)
        if core is None or not keys:
            return [False] * len(keys)
        return [core.save(core.named(keys), host_indices)] * len(keys)

    # -- the v2 interface: every pool of a hybrid model --------------------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: Any = None,
    ) -> PoolTransferResult:
        """The longest prefix of ``keys`` that the KV pool and every pool of
        ``pool_transfers`` can serve (``_hybrid.hit_query``)."""
        core = self._ready()
        if core is None or not keys:
            return PoolTransferResult(0, {}, [])
        return hit_query(keys, core.lookup(core.named(keys)), pool_transfers or [], self._pools)

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: Any = None
    ) -> dict[Any, list[bool]]:
        """Fill each transfer's pages; per pool, ``True`` for the leading pages loaded."""
        if self._ready() is None:
            return _none_moved(transfers)
        moves = self._checked(transfers)
        loaded = {t.name: pool.load(keys, t.host_indices) for t, pool, keys in moves}
        return {t.name: [i < loaded[t.name] for i in range(len(keys))] for t, _, keys in moves}

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: Any = None
    ) -> dict[Any, list[bool]]:
        """Store each transfer's pages; per pool, all ``True`` once stored."""
        if self._ready() is None:
            return _none_moved(transfers)
        moves = self._checked(transfers)
        return {t.name: [pool.save(keys, t.host_indices)] * len(keys) for t, pool, keys in moves}

    def _checked(
        self, transfers: list[PoolTransfer]
    ) -> list[tuple[PoolTransfer, StoredPool, list[str]]]:
        """Every transfer's pool and keys, each checked against its host indices before
        a byte of any of them moves (:class:`LayoutError`)."""
        moves = []
        for transfer in transfers:
            pool = registered(self._pools, transfer.name)
            keys = list(transfer.keys or [])
            pool.check(keys, transfer.host_indices)
            moves.append((transfer, pool, keys))
        return moves

    # -- the copying interface --------------------------------------------------------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """One flat page per key (into ``target_locations`` when given); ``None`` from the
        first page the store does not hold."""
        core = self._ready(zero_copy=False)
        if core is None or not keys:
            return [None] * len(keys)
        pool = self.mem_pool_host
        targets = list(target_locations or [pool.get_dummy_flat_data_page() for _ in keys])
        views = _flat_views(core, keys, targets, writable=True)
        got = core.get(core.named(keys), views)
        return [t if i < got else None for i, t in enumerate(targets)]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store one flat page per key; pages the store holds already are not sent."""
        core = self._ready(zero_copy=False)
        if core is None or not keys:
            return False
        views = _flat_views(core, keys, list(values or []), writable=False)
        return core.put(core.named(keys), views)

    # -- the rest -----------------------------------------------------------------------------

    def clear(self) -> bool:
        """Remove every page of this backend's namespaces (its KV pool's and any side
        pool's) from the store (SGLang's ``/clear_hicache_storage_backend``); other
        namespaces keep theirs. False when the store failed."""
        if self._ready() is None:
            return False
        return all([pool.core.clear() for pool in list(self._pools.values())])

    def stats(self) -> dict[str, Any]:
        """The connector's counters since start (lookups, hits, bytes loaded and saved) of
        the KV pool; a hybrid model's side pools' under ``pools``, by name."""
        if self._core is None:
            return {}
        totals = self._core.stats.totals()
        sides = {n: p.core.stats.totals() for n, p in self._pools.items() if n != KV}
        if sides:
            totals["pools"] = sides
        return totals

    def close(self) -> None:
        close_pools(self._pools)

    # -- internals --------------------------------------------------------------------------

    def _ready(self, zero_copy: bool | None = None) -> ConnectorCore | None:
        if zero_copy is not None and zero_copy != self.zero_copy:
            calls = "batch_get_v1/batch_set_v1" if self.zero_copy else "get/set/batch_get/batch_set"
            raise ConfigError(
                f"kvbridge: this backend was configured {'with' if self.zero_copy else 'without'}"
                f" interface_v1, for SGLang's {calls}"
            )
        if self._core is None and not self._warned:
            self._warned = True
            _log.warning("kvbridge HiCache backend used before SGLang registered its host pool")
        return self._core


def _flat_views(
    core: ConnectorCore, keys: Sequence[str], tensors: list[Any], *, writable: bool
) -> list[Any]:
    """The copying interface's page tensors as bytes, each a whole block."""
    if len(tensors) != len(keys):
        raise LayoutError(f"{len(keys)} key(s) but {len(tensors)} page tensor(s)")
    return [flat_bytes(t, core.identity.block_bytes, writable=writable) for t in tensors]


def _none_moved(transfers: list[PoolTransfer]) -> dict[Any, list[bool]]:
    return {t.name: [False] * len(t.keys or []) for t in transfers}
