"""The storage half of SGLang's ``HiCacheController``, with SGLang's own code.

``sglang.srt.managers.cache_controller`` imports the GPU runtime, so it cannot be imported
here; its prefetch and backup paths are plain Python over a storage backend and a host
pool. ``Controller`` runs exactly those methods (compiled from the installed wheel by
``sglang_source``): ``_page_transfer`` (prefetch: page gets in batches of
``STORAGE_BATCH_SIZE``, counting the leading hits) and ``_page_backup_or_log`` (backup:
page sets batch by batch, stopping at the first failed batch), on the zero-copy or the
copying interface as SGLang chooses them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from queue import Queue
from typing import Any, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    count_pool_hits,
)
from sglang_source import compiled

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
