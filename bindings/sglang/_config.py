"""The SGLang backend's settings and identity, from SGLang's ``HiCacheStorageConfig``,
its host pool, and the model settings SGLang publishes in the scheduler's process.

Settings come from ``--hicache-storage-backend-extra-config``: SGLang's own keys there
(``backend_name``, ``module_path``, ``class_name``, ``interface_v1``, ...) are SGLang's;
every other key is a :class:`ConnectorConfig` setting, checked, an unknown one named.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import sglang
from sglang.srt import runtime_context

from ...store import ConfigError
from ..core._config import ConnectorConfig
from ..core._identity import Identity, Weights, settings_digest, settle, weights

SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "tp_lcm_size",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)
"""Keys of the extra config that SGLang reads itself."""

_VLLM_ONLY = frozenset({"async_load", "pd_wait"})

DEFAULT_TIMEOUT_S = 5.0
"""HiCache treats storage as best effort: a store call that takes longer is a miss."""

_GEOMETRY = (
    "layer_num",
    "head_num",
    "head_dim",
    "v_head_dim",
    "kv_cache_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "start_layer",
    "end_layer",
    "num_mamba_layers",
    "temporal_state_shape",
    "temporal_dtype",
    "conv_state_shapes",
    "conv_dtype",
)
"""The host pool's attributes that shape a page's bytes (those a pool has: the KV pools'
and the Mamba state pool's)."""


def backend_config(storage: Any) -> tuple[ConnectorConfig, bool]:
    """The connector's settings and whether SGLang uses the zero-copy interface
    (``interface_v1``). Raises :class:`ConfigError` for a setting kvbridge cannot honour."""
    extra = dict(storage.extra_config or {})
    ours = {k: v for k, v in extra.items() if k not in SGLANG_KEYS}
    refused = sorted(set(ours) & _VLLM_ONLY)
    if refused:
        raise ConfigError(f"kvbridge: {', '.join(refused)} are vLLM settings, not SGLang's")
    ours.setdefault("timeout", DEFAULT_TIMEOUT_S)
    config = ConnectorConfig.from_extra(ours)
    if storage.should_split_heads:
        raise ConfigError("kvbridge: tp_lcm_size (heads split across unequal TP) is not supported")
    if storage.dcp_size > 1:
        raise ConfigError("kvbridge: decode context parallelism (dcp_size > 1) is not supported")
    if config.server is None and storage.is_mla_model and storage.tp_size > 1:
        raise ConfigError(
            "kvbridge: an MLA model under TP keeps one copy of its cache for every rank, "
            "written by rank 0 only: set server (a kvbridge serve that all ranks share)"
        )
    return config, bool(extra.get("interface_v1", 0))


def identity(storage: Any, pool: Any, block_bytes: int, path: str, namespace: str) -> Identity:
    """What a block's bytes mean: SGLang's version; the weights, by their bytes or commit,
    from the model settings SGLang published in this process (never ``model_name``, which
    is ``--served-model-name`` when one is set); the settings that change the bytes
    (:func:`_settings`); the host pool's dtype, layout and geometry; the page size; the
    interface (``path``: the zero-copy one moves a page's segments in the pool's order,
    the copying one SGLang's flat page, which differ for ``layer_first``); and the shard
    (MLA caches are the same on every TP rank). Weights in doubt (none published, or a
    hub branch with no commit in the local cache) make a namespace of this process's own
    unless ``namespace`` is set."""
    model = _published_model()
    named = _weights(model, storage)
    ident = Identity(
        engine=f"sglang-{sglang.__version__}",
        model=named.name,
        dtype=str(pool.dtype),
        layout=_layout(pool, path),
        block_tokens=int(pool.page_size),
        block_bytes=block_bytes,
        shard=_shard(storage, replicated=storage.is_mla_model),
        extra=namespace,
        settings="" if model is None else _settings(model),
    )
    return settle(ident, named.doubt)


def side_identity(
    kv: Identity, storage: Any, pool: Any, *, name: str, block_bytes: int, path: str
) -> Identity:
    """A hybrid model's side pool (``name``: Mamba state, SWA KV): the KV pool's identity
    (engine, weights, settings, the ``namespace`` setting and any salt: settled once) with
    this pool's name, bytes and layout, so that one page hash names another block in every
    pool. Mamba state is sharded by TP rank even where the KV is the same on every rank
    (an MLA model's): SGLang backs it up from every rank (``should_backup`` in
    ``hybrid_cache_controller.py``), and SGLang's file backend keys it by rank too."""
    return replace(
        kv,
        dtype=str(pool.dtype),
        layout=f"{name}:{_layout(pool, path)}",
        block_tokens=int(pool.page_size),
        block_bytes=block_bytes,
        shard=_shard(storage, replicated=storage.is_mla_model and name != "mamba"),
    )


def _layout(pool: Any, path: str) -> str:
    geometry = ",".join(f"{n}={getattr(pool, n)}" for n in _GEOMETRY if hasattr(pool, n))
    slot_states = getattr(pool, "slot_state_buffers", ())  # a Mamba pool's, in its pages
    side_states = [(tuple(t.shape[1:]), str(t.dtype)) for t in slot_states]
    if side_states:
        geometry += f",slot_states={side_states}"
    tag = getattr(pool, "storage_format_tag", None)
    return f"{type(pool).__name__}/{pool.layout}/{tag}/{path}/{geometry}"


def _shard(storage: Any, *, replicated: bool) -> str:
    rank = "mla" if replicated else f"tp{storage.tp_rank}/{storage.tp_size}"
    return (
        f"{rank},pp{storage.pp_rank}/{storage.pp_size},"
        f"cp{storage.attn_cp_rank}/{storage.attn_cp_size}"
    )


_SETTINGS = (
    "dtype",
    "quantization",
    "modelopt_quant",
    "kv_cache_dtype",
    "load_format",
    "model_impl",
    "model_config_parser",
    "trust_remote_code",
    "context_length",
)
"""SGLang's model settings that change the KV bytes of the same token ids, besides the
weights, ``json_model_override_args`` and ``quantization_param_path`` (docs/SGLANG.md,
"Keys and namespaces", says why each is here and why others are not)."""


def _published_model() -> Any | None:
    """The model settings SGLang resolved and published in this process (its ``model``
    config bag: the scheduler publishes it before it builds the cache controller), or
    None where none is published."""
    try:
        return runtime_context.get_model()
    except ValueError:  # "... not published"
        return None


def _weights(model: Any | None, storage: Any) -> Weights:
    if model is None:
        return Weights(
            "",
            f"SGLang published no model settings in this process, and its storage config "
            f"names the model only as {storage.model_name!r}, which may be an alias "
            "(--served-model-name)",
        )
    return weights(str(model.model_path), model.revision, model.download_dir)


def _settings(model: Any) -> str:
    values = {name: getattr(model, name, None) for name in _SETTINGS}
    values["json_model_override_args"] = json.loads(model.json_model_override_args or "{}")
    scales = model.quantization_param_path  # fp8 KV scales: named by the file's bytes
    values["quantization_param_path"] = weights(scales).name if scales else None
    return settings_digest(values)
