"""kvbridge.bindings: kvbridge inside serving engines.

- An engine-agnostic connector core (:class:`ConnectorCore`): block keys from token ids
  in a namespace that names the model, dtype, layout, block size and shard
  (:class:`Identity`), cached lookups that remember failed keys, pins between a lookup and
  its load, loads, saves on a thread of its own, and counters (:class:`ConnectorStats`).
  It keeps blocks in a ``kvbridge serve`` or in a store inside the engine process
  (:class:`ConnectorConfig`), moving the engine's KV cache as pages (:class:`PagedKV`).
- ``kvbridge.bindings.vllm``: the vLLM adapter, ``KVBridgeConnector`` (imports vLLM).
- ``kvbridge.bindings.sglang``: the SGLang HiCache backend, ``KVBridgeHiCache`` (imports
  sglang).

Layout: ``core/`` (engine-agnostic), ``vllm/`` and ``sglang/`` (one adapter each).
"""

from __future__ import annotations

from .core import (
    ConnectorConfig,
    ConnectorCore,
    ConnectorStats,
    Identity,
    LayoutError,
    PagedKV,
    SaveJob,
    pages_of,
)

__all__ = [
    "ConnectorConfig",
    "ConnectorCore",
    "ConnectorStats",
    "Identity",
    "LayoutError",
    "PagedKV",
    "SaveJob",
    "pages_of",
]
