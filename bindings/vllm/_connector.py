"""kvbridge as a vLLM KV connector (vLLM 0.32, ``KVConnectorBase_V1``).

Load it with::

    --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
                           "kv_connector_module_path": "kvbridge.bindings.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"server": "127.0.0.1:7400",
                                                         "secret_file": "/etc/kvbridge/secret"}}'

``kv_both`` is a shared prefix cache (load the longest cached prefix, save every full
prompt block); ``kv_producer`` (a prefill instance) only saves, ``kv_consumer`` (a decode
instance) only loads. Settings: :class:`kvbridge.bindings.ConnectorConfig`. How it maps
vLLM's calls: ``docs/VLLM.md``.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from ..core._config import ConnectorConfig
from ..core._core import ConnectorCore
from ..core._identity import Identity, effective_config, settings_digest, settle, weights
from ._groups import KVGroups
from ._meta import Handshake, KVBridgeStats, StepMeta, WorkerReport
from ._metrics import KVBridgePromMetrics
from ._scheduler import LOOKUP_THREADS, SchedulerSide
from ._versions import kv_format
from ._worker import WorkerSide

__all__ = ["KVBridgeConnector"]

_log = logging.getLogger("kvbridge.bindings")


class KVBridgeConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """A vLLM KV connector whose blocks live in kvbridge. It supports vLLM's hybrid KV
    cache manager (``SupportsHMA``): a model of several KV cache groups keeps them."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config)
        worker = role == KVConnectorRole.WORKER
        groups = KVGroups.of(kv_cache_config)
        identity = _identity(vllm_config, kv_cache_config, config, rank=_rank() if worker else 0)
        if not groups.loadable and not worker:
            _log.warning(
                "kvbridge: this model's KV cache groups (%s) include one whose state vLLM "
                "gives a connector no way to store and load soundly (a recurrent state: "
                "Mamba, linear attention): the connector loads and saves nothing for it",
                groups.describe(),
            )
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError("kvbridge: pipeline parallelism is not supported (its stages' keys)")
        if config.server is None and parallel.world_size > 1:
            raise ValueError("kvbridge: the in-process cache serves one worker; set 'server'")
        saves = bool(transfer.is_kv_producer)
        self._core = ConnectorCore(
            config,
            identity,
            saves=saves and worker,
            mirror=not worker,
            connections=1 if worker else LOOKUP_THREADS,
            token_ids=True,  # saves carry them: KV-aware routers index the store by them
        )
        self._handshake: Handshake | None = None
        if worker and config.server is None:  # the store lives here; the scheduler connects
            self._handshake = Handshake(*self._core.host())
        in_flight = int(getattr(vllm_config, "max_concurrent_batches", 1) or 1)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if worker:
            self._worker = WorkerSide(
                self._core,
                in_flight,
                loader=config.async_load or groups.hybrid,
                by_request=groups.hybrid,
                moves=groups.loadable,
                layout=str(getattr(kv_cache_config, "kv_cache_layout", None) or ""),
            )
        else:
            self._scheduler = SchedulerSide(
                self._core,
                groups,
                loads=bool(transfer.is_kv_consumer),
                saves=saves,
                steps_in_flight=in_flight,
                async_loads=config.async_load,
            )

    # -- scheduler side -----------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().allocated(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._sched().build(scheduler_output)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """The cache server the worker runs, when no ``server`` is configured."""
        shake = metadata.get(0)
        if isinstance(shake, Handshake) and self._core.config.server is None:
            self._core.connect(shake.address, shake.secret)

    def update_connector_output(self, connector_output: Any) -> None:
        report = connector_output.kv_connector_worker_meta
        self._sched().report(report if isinstance(report, WorkerReport) else None)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``: what ``request_finished`` is, for every KV cache group (vLLM
        calls only this once the connector supports HMA, one group or several)."""
        return self._sched().finished(request)

    def may_load_async(self, request: Any) -> bool:
        """vLLM 0.34's hook (``--max-num-inflight-kv-loads``): whether
        ``get_num_new_matched_tokens`` may answer an async load for ``request``. Cheap, as
        vLLM asks on every queueing: this instance loads, asynchronously (``async_load``, or
        any hybrid model), a model whose groups it can load."""
        return self._sched().may_load_async()

    # -- worker side ----------------------------------------------------------------------

    def get_handshake_metadata(self) -> Handshake | None:
        return self._handshake

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._work().register(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        self._work().preempted(_meta(kv_connector_metadata))

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._work().load(_meta(self._connector_metadata))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finished in start_load_kv, before the forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole blocks are saved after the forward, in wait_for_save

    def wait_for_save(self) -> None:
        self._work().save(_meta(self._connector_metadata))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, receiving, _ = self._work().finished(finished_req_ids)
        return sending, receiving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """What ``get_finished`` says, and the async loads that failed (by request)."""
        sending, receiving, failed = self._work().finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(receiving or ()),
            failed_recving=failed,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().load_errors()

    def build_connector_worker_meta(self) -> WorkerReport | None:
        return self._work().report()

    def get_kv_connector_stats(self) -> KVBridgeStats | None:
        return self._work().stats() if self._worker is not None else None

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No, for every role (vLLM 0.33's hook, whose default is yes; vLLM 0.32 never
        asks): sleep mode frees the KV cache's memory and maps it again on wake, and this
        connector neither drains its loads and saves first (its threads could touch the
        unmapped memory) nor registers the cache again after (``unregister_kv_caches``,
        ``restore_kv_caches``: a UCX registration would point at stale memory). vLLM then
        refuses ``--enable-sleep-mode`` with this connector, at start."""
        return False

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34's hook, asked before the KV cache is allocated: ``REGISTERS`` when the
        workers may register the cache with UCX or NIXL (``transports`` ``ucx``, ``nixl`` or
        ``auto``), which
        needs each segment backed by one physical allocation; else ``IN_PROCESS`` (reads and
        writes through the process, as TCP does). Before 0.34 vLLM never asks and has no
        ``KVCacheAccess``: the answer is then the member's name."""
        extra = getattr(kv_transfer_config, "kv_connector_extra_config", None) or {}
        registers = ConnectorConfig.from_extra(extra).transports in ("ucx", "nixl", "auto")
        return _access("REGISTERS" if registers else "IN_PROCESS")

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBridgeStats:
        return KVBridgeStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVBridgePromMetrics:
        return KVBridgePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()
        self._core.close()

    def wait_ready(self, timeout: float) -> bool:
        """Whether, within ``timeout`` seconds, this side reached its cache server and (on
        the scheduler's side, with an event stream) holds the namespace's keys in step:
        for a readiness probe (an instance whose first requests should hit), and for
        tests. Requests never wait for it."""
        return self._core.wait_ready(timeout)

    @property
    def stats(self) -> dict[str, Any]:
        """This side's counters since it started (``kvbridge.bindings.ConnectorStats``)."""
        return self._core.stats.totals()

    # -- internals ------------------------------------------------------------------------

    def _sched(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on a worker connector"
        return self._scheduler

    def _work(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on a scheduler connector"
        return self._worker


def _meta(meta: Any) -> StepMeta | None:
    return meta if isinstance(meta, StepMeta) else None


def _access(name: str) -> Any:
    """vLLM's ``KVCacheAccess`` member ``name`` (0.34), or ``name`` where vLLM has none."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: PLC0415
            KVCacheAccess,
        )
    except ImportError:
        return name
    return KVCacheAccess[name]


def _rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank  # noqa: PLC0415

    return int(get_tensor_model_parallel_rank())


def _identity(
    vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig, rank: int
) -> Identity:
    """What the KV bytes mean, from vLLM's configs (equal on the scheduler and workers):
    the KV format of this vLLM (:func:`kv_format`), the weights by their bytes or commit
    (never ``served_model_name``), the settings that change the bytes (:func:`_settings`),
    the cache's dtype, layout and geometry, and the shard. Weights in doubt (a hub branch
    with no commit in the local cache) make a namespace salted with vLLM's ``engine_id``,
    which the scheduler and workers share."""
    groups = KVGroups.of(kv_cache_config)
    attention = [g.index for g in groups.groups if g.kind in ("full", "window")]
    spec = kv_cache_config.kv_cache_groups[(attention or [0])[0]].kv_cache_spec
    layers = len(kv_cache_config.kv_cache_groups[0].layer_names)
    kinds = f"/{groups.describe()}" if groups.hybrid else ""
    model = vllm_config.model_config
    import vllm  # noqa: PLC0415
    from vllm.platforms import current_platform  # noqa: PLC0415

    named = weights(model.model, model.revision, vllm_config.load_config.download_dir)
    identity = Identity(
        engine=kv_format(vllm.__version__),
        model=named.name,
        dtype=str(getattr(spec, "dtype", "none")),
        layout=f"{current_platform.device_type}/{type(spec).__name__}/"
        f"{getattr(spec, 'num_kv_heads', 0)}x{getattr(spec, 'head_size', 0)}/{layers}/"
        f"{kv_cache_config.kv_cache_layout}{kinds}",
        block_tokens=int(spec.block_size),
        block_bytes=_page_bytes(spec) * layers,
        shard=_shard(vllm_config.parallel_config, rank),
        extra=config.namespace,
        settings=_settings(vllm_config),
    )
    identity = settle(identity, named.doubt, salt=str(vllm_config.kv_transfer_config.engine_id))
    _log.info(
        "kvbridge namespace %s: weights %s, settings %s",
        identity.namespace().decode(),
        identity.model,
        identity.settings,
    )
    return identity


def _page_bytes(spec: Any) -> int:
    """The bytes of a layer's page that hold KV: without the padding vLLM may add to
    align pages (``page_size_padded``: DeepSeek's MLA), which kvbridge never moves."""
    return int(getattr(spec, "real_page_size_bytes", spec.page_size_bytes))


def _shard(parallel: Any, rank: int) -> str:
    """Which part of each block's KV this worker holds: its TP rank, and the context
    parallelism that spreads a block's tokens over ranks."""
    return (
        f"tp{rank}/{parallel.tensor_parallel_size},pp{parallel.pipeline_parallel_size},"
        f"dcp{parallel.decode_context_parallel_size},pcp{parallel.prefill_context_parallel_size}"
        f"/{parallel.cp_kv_cache_interleave_size}"
    )


def _settings(vllm_config: Any) -> str:
    """vLLM's settings that change the KV bytes of the same token ids (docs/VLLM.md, "Keys
    and namespaces", says why each is here and why others are not)."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    return settings_digest(
        {
            "hf_config": effective_config(model.hf_config.to_dict()),  # hf_overrides applied
            "dtype": str(model.dtype),
            "quantization": model.quantization,
            "quantization_config": model.quantization_config,
            "load_format": vllm_config.load_config.load_format,
            "model_impl": model.model_impl,
            "trust_remote_code": model.trust_remote_code,
            "code_revision": model.code_revision,
            "max_model_len": model.max_model_len,
            "cache_dtype": cache.cache_dtype,
            "cache_dtype_skip_layers": cache.kv_cache_dtype_skip_layers,
        }
    )
