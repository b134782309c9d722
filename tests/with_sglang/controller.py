"""The storage half of SGLang's ``HiCacheController``, with SGLang's own code.

``sglang.srt.managers.cache_controller`` imports the GPU runtime, so it cannot be imported
here; its prefetch and backup paths are plain Python over a storage backend and a host
pool. ``Controller`` runs exactly those methods (compiled from the installed wheel by
``sglang_source``): ``_page_transfer`` (prefetch: page gets in batches of
``STORAGE_BATCH_SIZE``, counting the leading hits) and ``_page_backup_or_log`` (backup:
page sets batch by batch, stopping at the first failed batch), on the zero-copy or the
copying interface as SGLang chooses them.

``Hybrid`` is the storage half of SGLang 0.5.23's ``HybridCacheController`` (every
model's controller there: a plain one's pool group is its KV pool alone), over
``Controller``: its hit query, prefetch and backup methods compiled from the wheel
(``hybrid_cache/hybrid_cache_controller.py``) over ``Controller`` as their base, so that
their ``super()`` reaches SGLang's base methods, as in SGLang.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from queue import Empty, Queue
from types import SimpleNamespace
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
    count_pool_hits,
)
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang_source import compiled, subclass

CC = "sglang.srt.managers.cache_controller"
LOG = logging.getLogger(CC)

_scope: dict[str, Any] = {
    "torch": torch,
    "threading": threading,
    "time": time,
    "dataclass": dataclass,
    "Any": Any,
    "List": list,
    "Optional": Optional,
    "logger": LOG,
    "STORAGE_BATCH_SIZE": STORAGE_BATCH_SIZE,
    "HiCacheStorageExtraInfo": HiCacheStorageExtraInfo,
    "PoolName": PoolName,
    "PoolTransfer": PoolTransfer,
    "count_pool_hits": count_pool_hits,
}
_parts = compiled(CC, ("PrefetchAck", "StorageOperation", "PrefetchOperation"), _scope)
_METHODS = compiled(
    CC,
    (
        "_page_get_zero_copy",
        "_generic_page_get",
        "_page_transfer",
        "_page_transfer_kv_batch",
        "_generic_page_set",
        "_page_set_zero_copy",
        "_page_backup",
        "_page_backup_or_log",
    ),
    _scope,
    within="HiCacheController",
)


class Controller:
    """What ``HiCacheController`` holds for storage I/O, and its methods."""

    # SGLang's methods, set below
    _page_get_zero_copy: Any
    _generic_page_get: Any
    _page_set_zero_copy: Any
    _generic_page_set: Any
    _page_transfer: Any
    _page_backup_or_log: Any

    def __init__(self, backend: Any, pool: Any) -> None:
        self.storage_backend = backend
        self.storage_host_pool = self.mem_pool_host = pool
        self.page_size = int(pool.page_size)
        self.prefetch_sync_queue: Queue[Any] = Queue()
        zero_copy = bool(backend.storage_config.extra_config.get("interface_v1", 0))
        self.page_get_func = self._page_get_zero_copy if zero_copy else self._generic_page_get
        self.page_set_func = self._page_set_zero_copy if zero_copy else self._generic_page_set

    def prefetch(self, keys: list[str], host_indices: torch.Tensor) -> int:
        """Pages loaded into ``host_indices``: the leading run SGLang would use."""
        operation = _parts["PrefetchOperation"]("req", token_ids=[], prefix_keys=[])
        operation.hash_value = keys
        operation.host_indices = host_indices
        return int(self._page_transfer(operation))

    def backup(self, keys: list[str], host_indices: torch.Tensor) -> int:
        """Pages SGLang counts as written to storage."""
        operation = _parts["StorageOperation"](host_indices, [], hash_value=keys, prefix_keys=[])
        self._page_backup_or_log(operation)
        return int(operation.completed_tokens) // self.page_size


for _name, _method in _METHODS.items():
    setattr(Controller, _name, _method)


HCC = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller"
_hybrid_scope: dict[str, Any] = {
    **_scope,
    "PoolHitPolicy": PoolHitPolicy,
    "PoolTransferResult": PoolTransferResult,
    "get_storage_hash_str": get_storage_hash_str,
    "replace": replace,
    "field": field,
    "Empty": Empty,
    "logger": logging.getLogger(HCC),
    "_NO_POOL_VERDICT": -1,
    "BaseStorageOperation": _parts["StorageOperation"],
    "PrefetchAck": _parts["PrefetchAck"],
    "CacheRequestHandle": Any,
    "MHATokenToKVPoolHost": type(None),  # read only for Mooncake's draft pools
}
compiled(HCC, ("_trailing_chain_groups", "StorageOperation", "PrefetchOperation"), _hybrid_scope)
_BACKUP_SKIP = compiled(CC, ("backup_skip",), _scope, within="HiCacheController")
HybridStorageOperation: Any = _hybrid_scope["StorageOperation"]
HybridPrefetchOperation: Any = _hybrid_scope["PrefetchOperation"]

_HybridMethods: Any = subclass(
    HCC,
    "HybridCacheController",
    (
        "_storage_hit_query",
        "_sync_prefetch_hit_query",
        "_page_transfer",
        "_page_transfer_with_stable_layout",
        "_page_transfer_sidecar",
        "_sync_trailing_keys",
        "_resolve_sidecar_kv_derived_pool_transfers",
        "_resolve_sidecar_nonkv_derived_pool_transfers",
        "_page_backup",
        "_page_backup_with_stable_layout",
        "should_backup",
    ),
    _hybrid_scope,
    Controller,
)


class HostGroup:
    """What the controller reads of SGLang's ``HostPoolGroup`` (``pool_host/group.py``,
    whose module imports the GPU runtime): the pools by name, the first the anchor."""

    def __init__(self, pools: dict[str, Any]) -> None:
        self.entries = [
            SimpleNamespace(name=PoolName(name), host_pool=pool) for name, pool in pools.items()
        ]
        self.entry_map = {entry.name: entry for entry in self.entries}
        self.anchor_entry = self.entries[0]
        self.page_size = self.anchor_entry.host_pool.page_size

    def layout_lease(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # no pool here shares a host arena


@dataclass
class Fetched:
    """What a prefetch delivered, as SGLang's ACKs say it: KV tokens, pages per side pool."""

    tokens: int
    pool_hits: dict[str, int]


class Hybrid(_HybridMethods):  # type: ignore[misc]
    """SGLang's ``HybridCacheController`` storage paths over a backend and a pool group, on
    one TP rank (its rank collectives reduce nothing)."""

    backup_skip = _BACKUP_SKIP["backup_skip"]

    def __init__(self, backend: Any, group: HostGroup) -> None:
        super().__init__(backend, group.anchor_entry.host_pool)
        self.mem_pool_host = group
        self.storage_backend_type = "dynamic"
        self.storage_config = backend.storage_config
        self.prefetch_hits_sync_groups: list[Any] = []
        self.released: list[PoolTransfer] = []

    def _all_reduce(self, tensor: Any, op: Any, groups: Any) -> None:
        """One rank: MIN over itself."""

    def append_host_mem_release(
        self, host_indices: Any = None, extra_pools: list[PoolTransfer] | None = None
    ) -> None:
        self.released.extend(extra_pools or [])

    def attach(self) -> None:
        """The registration of ``HybridCacheController.attach_storage_backend``: the anchor
        (``register_mem_pool_host``, in the base class's attach), then every pool of the
        group by name, then ``on_host_pools_registered()``."""
        group = self.mem_pool_host
        self.storage_backend.register_mem_pool_host(group.anchor_entry.host_pool)
        for entry in group.entries:
            self.storage_backend.register_mem_host_pool_v2(entry.host_pool, entry.name)
        self.storage_backend.on_host_pools_registered()

    def backup(
        self, keys: list[str], host_indices: torch.Tensor, pools: list[PoolTransfer] | None = None
    ) -> int:
        """Back up one node's pages (``write_storage`` then the backup thread); the KV
        tokens SGLang counts as written."""
        operation = HybridStorageOperation(
            host_indices, [], hash_value=keys, prefix_keys=None, pool_transfers=pools
        )
        self._page_backup_or_log(operation)
        return int(operation.completed_tokens)

    def query(self, token_ids: list[int], pools: list[PoolTransfer] | None = None) -> Any:
        """The prefetch thread's hit query for ``token_ids``, rank-reduced: the operation,
        its ``hash_value`` cut to the hit and ``storage_hit_count`` set."""
        operation = HybridPrefetchOperation(
            SimpleNamespace(rid="req"), token_ids, pool_transfers=pools
        )
        hashes, hit = self._storage_hit_query(operation)
        hit = self._sync_prefetch_hit_query(operation, hit)
        operation.hash_value = hashes[: hit // self.page_size]
        operation.storage_hit_count = hit
        return operation

    def fetch(
        self, operation: Any, kv_slots: torch.Tensor, slots: dict[str, torch.Tensor]
    ) -> Fetched:
        """Stage the hit as the radix cache does (KV slots for the hit; per side pool, a
        slot per page of its keys up to the hit: ``_alloc_prefetch_aux_staging``), then the
        prefetch I/O (``_page_transfer``)."""
        operation.host_indices = kv_slots
        for transfer in operation.pool_transfers or []:
            transfer.host_indices = slots[str(transfer.name)]
        self._page_transfer(operation)
        fetched = Fetched(0, {})
        while not self.prefetch_sync_queue.empty():
            ack = self.prefetch_sync_queue.get()
            if ack.completed_tokens is not None:
                fetched.tokens = ack.completed_tokens
            fetched.pool_hits.update({str(k): v for k, v in (ack.pool_hits or {}).items()})
        return fetched
