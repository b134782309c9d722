"""kvbridge.bindings.vllm: the vLLM KV connector, :class:`KVBridgeConnector` (imports vLLM;
the versions it supports: ``SUPPORTED_VLLM``; the KV format each writes: ``kv_format``).
Load it with ``kv_connector_module_path="kvbridge.bindings.vllm"``.

``_connector`` routes vLLM's calls to its two sides: ``_scheduler`` (what to load, what to
save, a request's end) and ``_worker`` (register the cache, load, queue saves, report);
``_meta`` is what crosses between them each step, ``_metrics`` the connector's Prometheus
metrics, ``_versions`` the vLLM versions it supports and their KV formats. The
engine-agnostic work is ``bindings/core``'s. See ``docs/VLLM.md``.
"""

from __future__ import annotations

from ._connector import KVBridgeConnector
from ._versions import KV_FORMATS, SUPPORTED_VLLM, kv_format

__all__ = ["KV_FORMATS", "SUPPORTED_VLLM", "KVBridgeConnector", "kv_format"]
