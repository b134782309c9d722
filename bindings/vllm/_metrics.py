"""The connector's counters as Prometheus metrics of vLLM's ``/metrics``
(``vllm:kvbridge_<counter>``, one child per engine), fed by the per-interval
:class:`KVBridgeStats` that vLLM gathers from the workers."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

from ..core._stats import COUNTERS, TIMINGS

_HELP = {
    "lookups": "Prefix lookups the scheduler made in kvbridge",
    "lookups_late": "Lookups not answered within lookup_wait (the request computed its prefix)",
    "lookups_local": "Lookups the mirror of the store's event stream answered (no call)",
    "tokens_looked_up": "Prompt tokens (full blocks) looked up in kvbridge",
    "tokens_hit": "Prompt tokens kvbridge held at lookup",
    "tokens_loaded": "Tokens whose KV was loaded from kvbridge",
    "bytes_loaded": "Bytes of KV loaded from kvbridge",
    "load_failures": "Loads that failed (their tokens were recomputed or the request failed)",
    "tokens_load_failed": "Tokens whose load failed",
    "tokens_lost_gone": "Hit tokens not loaded: evicted or removed between lookup and read",
    "tokens_lost_corrupt": "Hit tokens not loaded: a block failed its checksum once landed",
    "tokens_lost_lease": "Hit tokens not loaded: the read outlived its lease",
    "tokens_lost_timeout": "Hit tokens not loaded: the read timed out",
    "tokens_lost_fault": "Hit tokens not loaded: the store failed or refused",
    "tokens_lost_paused": "Hit tokens not loaded: store calls paused after a fault",
    "tokens_lost_declined": "Hit tokens offered that vLLM did not take to load",
    "tokens_saved": "Prompt tokens offered to kvbridge in full blocks",
    "bytes_saved": "Bytes of KV written to kvbridge (blocks it lacked)",
    "blocks_not_saved": "Blocks not saved because the store was unreachable",
    "store_faults": "kvbridge calls that failed (the connector paused its calls after each)",
    "bytes_staged": "Bytes of KV copied through the host staging buffer (a GPU cache's path)",
    "lookup_seconds": "Seconds spent in kvbridge lookups",
    "load_seconds": "Seconds spent loading KV from kvbridge",
    "save_seconds": "Seconds spent saving KV to kvbridge (off the engine step)",
}


class KVBridgePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name in (*COUNTERS, *TIMINGS):
            counter = self._counter_cls(
                name=f"vllm:kvbridge_{name}", documentation=_HELP[name], labelnames=labelnames
            )
            self._counters[name] = create_metric_per_engine(counter, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and value:
                per_engine[engine_idx].inc(value)
