"""The worker side takes the KV cache exactly as vLLM 0.32 hands it to
``register_kv_caches``: one 4-D ``[B, H, N, C]`` view per layer of ONE shared allocation,
in every :class:`KVCacheLayout` (LBHNC, LBNHC: vLLM's pick on H100/H200, LHBNC, and the
block-outermost BLHNC, BLNHC, BHLNC), built by vLLM's own code on CPU tensors
(``get_kv_cache_groups``, ``get_kv_cache_config_from_groups``, then the worker's
``allocate_kv_cache``, which calls ``create_kv_cache_views``; no copy of their logic).

Specs: full attention with 8 and with 1 KV heads (head size 64, bf16 and an fp8 cache),
and MLA as vLLM's MLA layer makes it (bf16; ``fp8_ds_mla``'s 656-byte token) and as
DeepSeek-V4's compressed layer does (``fp8_ds_mla``'s 584-byte state, its page padded to a
multiple of 576: ``page_size_padded``).

A layout whose blocks are one run of bytes (any axis order inside the block, padded pages
too) round-trips through a real ``kvbridge serve``, directly and staged: blocks saved from
one cache load into a second, zeroed cache of the same layout at other ids, equal byte for
byte as the views hold them, and nothing else of it changes. Where H lies outside B and a
layer has more than one head (LHBNC, BHLNC), a layer's page is not one run: registering is
a ConfigError naming the layer and the layout. Where B is outermost, a block spans every
layer's page and moves as one segment."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import until
from serve import ServeProcess
from vllm.config import CacheConfig, VllmConfig
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.attention.backends.utils import record_kv_cache_layout

try:  # where vLLM 0.33 keeps them
    from vllm.v1.core.kv_cache_planning import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import (
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MLAAttentionSpec,
    get_kv_quant_mode,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvbridge.bindings import ConnectorConfig, ConnectorCore, Identity
from kvbridge.bindings.core import PageLayout
from kvbridge.bindings.vllm._meta import StepMeta, Transfer
from kvbridge.bindings.vllm._worker import WorkerSide
from kvbridge.store import ConfigError

BLOCKS, TOKENS, LAYERS = 12, 16, 3
NAMES = [f"model.layers.{i}.self_attn" for i in range(LAYERS)]
SAVED, LOADED = [3, 0, 7, 8], [10, 4, 1, 6]
"""Engine block ids saved from the first cache, and where the second one loads them."""

SPECS: dict[str, KVCacheSpec] = {
    # vllm/model_executor/layers/attention/attention.py (get_kv_cache_spec)
    **{
        f"full-{heads}h-{name}": FullAttentionSpec(
            block_size=TOKENS,
            num_kv_heads=heads,
            head_size=64,
            dtype=dtype,
            kv_quant_mode=get_kv_quant_mode(cache),
        )
        for heads in (8, 1)
        for name, dtype, cache in (
            ("bf16", torch.bfloat16, "auto"),
            ("fp8", torch.float8_e4m3fn, "fp8"),
        )
    },
    # vllm/model_executor/layers/attention/mla_attention.py (get_kv_cache_spec): a
    # 512-wide latent and 64 RoPE dims; fp8_ds_mla packs a token into 656 opaque bytes
    "mla-bf16": MLAAttentionSpec(
        block_size=TOKENS, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.bfloat16
    ),
    "mla-fp8_ds_mla": MLAAttentionSpec(
        block_size=TOKENS,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=576,
        dtype=kv_cache_dtype_str_to_dtype("fp8_ds_mla", None),
        cache_dtype_str="fp8_ds_mla",
        kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"),
        state_content_bytes=656,
    ),
    # vllm/models/deepseek_v4/attention.py (a compressed layer, ratio 4): 584-byte
    # states, the page rounded up to a multiple of 576 (page_size_padded)
    "mla-fp8_ds_mla-padded": MLAAttentionSpec(
        block_size=TOKENS,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=512,
        dtype=torch.uint8,
        tokens_per_state=4,
        cache_dtype_str="fp8_ds_mla",
        alignment=576,
        model_version="deepseek_v4",
        kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"),
        state_content_bytes=584,
    ),
}
PATHS: dict[str, dict[str, Any]] = {
    "direct": {},
    # two blocks of the largest spec (3 x 32 KiB): a batch of 4 is staged in rounds
    "staged": {"staging": "always", "staging_bytes": "192KiB"},
}


def _one_run(layout: KVCacheLayout, spec: KVCacheSpec) -> bool:
    """Whether each layer's page is one run of bytes: H inside B (vLLM's
    ``is_block_compact``), or a single head, so that H's place does not matter."""
    return bool(layout.is_block_compact or spec.num_heads == 1)


CASES = [(layout, spec) for layout in KVCacheLayout for spec in SPECS]
DENSE = [
    pytest.param(layout, spec, id=f"{layout.name}-{spec}")
    for layout, spec in CASES
    if _one_run(layout, SPECS[spec])
]
SPLIT = [
    pytest.param(layout, spec, id=f"{layout.name}-{spec}")
    for layout, spec in CASES
    if not _one_run(layout, SPECS[spec])
]
OUTERMOST = [
    pytest.param(layout, spec, id=f"{layout.name}-{spec}")
    for layout, spec in CASES
    if layout.is_block_outermost and _one_run(layout, SPECS[spec])
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    served = ServeProcess("--host-capacity", "64MiB")
    try:
        yield served
    finally:
        served.kill()


def _plan(layout: KVCacheLayout, spec: KVCacheSpec) -> KVCacheConfig:
    """vLLM's KV cache config for ``LAYERS`` layers of ``spec`` in ``BLOCKS`` blocks, as
    its engine core makes it once the layout is resolved."""
    config = VllmConfig(cache_config=CacheConfig(block_size=TOKENS, num_gpu_blocks_override=BLOCKS))
    record_kv_cache_layout(config.cache_config, layout.name)
    groups = get_kv_cache_groups(config, dict.fromkeys(NAMES, spec))
    plan: KVCacheConfig = get_kv_cache_config_from_groups(config, groups, 1 << 30)
    plan.kv_cache_layout = config.cache_config.kv_cache_layout
    assert plan.num_blocks == BLOCKS
    return plan


def _allocate(plan: KVCacheConfig, layout: KVCacheLayout) -> dict[str, torch.Tensor]:
    """A fresh, zeroed KV cache: what the worker's model runner registers."""
    views: dict[str, torch.Tensor] = allocate_kv_cache(plan, torch.device("cpu"), layout)
    assert list(views) == NAMES
    return views


def _fill(views: dict[str, torch.Tensor], seed: int) -> None:
    """Random bytes over the whole allocation the views share (padding too)."""
    storage = next(iter(views.values())).untyped_storage()
    raw = torch.empty(0, dtype=torch.uint8).set_(storage)
    generator = torch.Generator().manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def _page(view: torch.Tensor, block: int) -> bytes:
    """One (layer, block)'s bytes, read through the view vLLM's kernels use."""
    return bytes(view[block].contiguous().view(torch.uint8).flatten().numpy().tobytes())


class _Core(ConnectorCore):
    """A ConnectorCore that keeps the engine memory the worker side attaches."""

    attached: PageLayout | None = None

    def attach(self, memory: PageLayout) -> None:
        self.attached = memory
        super().attach(memory)


def _kv_bytes(spec: Any) -> int:
    """The KV bytes of a page, as the connector's identity counts them: vLLM's padding
    (``page_size_padded``) is never moved."""
    return int(getattr(spec, "real_page_size_bytes", spec.page_size_bytes))


def _side(
    server: ServeProcess, spec_name: str, layout: KVCacheLayout, extra: dict[str, Any], saves: bool
) -> tuple[WorkerSide, _Core]:
    spec = SPECS[spec_name]
    identity = Identity(
        engine="test",
        model="m",
        dtype=str(getattr(spec, "dtype", "")),
        layout=f"vllm/{layout.name}/{spec_name}",
        block_tokens=TOKENS,
        block_bytes=_kv_bytes(spec) * LAYERS,
        shard="tp0/1",
    )
    config = ConnectorConfig.from_extra({"server": server.address, **extra})
    core = _Core(config, identity, saves=saves)
    return WorkerSide(core, layout=layout.name), core


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize(("layout", "spec"), DENSE)
def test_blocks_of_every_one_run_layout_round_trip_byte_for_byte(
    server: ServeProcess, layout: KVCacheLayout, spec: str, path: str
) -> None:
    plan = _plan(layout, SPECS[spec])
    source, target = _allocate(plan, layout), _allocate(plan, layout)
    _fill(source, seed=7)
    extra = {**PATHS[path], "namespace": f"{layout.name}-{spec}-{path}"}
    _save_then_load(server, spec, layout, extra, source=source, target=target)
    for name in NAMES:
        for saved, loaded in zip(SAVED, LOADED, strict=True):
            assert _page(target[name], loaded) == _page(source[name], saved), (name, loaded)
        for block in set(range(BLOCKS)) - set(LOADED):
            assert not any(_page(target[name], block)), (name, block)


def _save_then_load(
    server: ServeProcess,
    spec: str,
    layout: KVCacheLayout,
    extra: dict[str, Any],
    *,
    source: dict[str, torch.Tensor],
    target: dict[str, torch.Tensor],
) -> None:
    """As vLLM drives the worker side: ``source``'s blocks ``SAVED`` saved at
    ``wait_for_save`` by one engine, loaded into ``target``'s ``LOADED`` at
    ``start_load_kv`` by another, through the server; no load failed."""
    saver, saving = _side(server, spec, layout, extra, saves=True)
    loader, loading = _side(server, spec, layout, extra, saves=False)
    try:
        saver.register(source)
        loader.register(target)
        keys = tuple(saving.keys(list(range(TOKENS * len(SAVED)))))
        saver.save(StepMeta(saves=[Transfer("a", keys, tuple(SAVED))]))
        until(lambda: not saving.saving("a"), "the saves ran")
        assert loading.lookup(keys) == len(keys)
        loader.load(StepMeta(loads=[Transfer("b", keys, tuple(LOADED))]))
        assert loader.load_errors() == set()
        assert loader.report() is None
    finally:
        for side, core in ((saver, saving), (loader, loading)):
            side.close()
            core.close()


@pytest.mark.parametrize(("layout", "spec"), SPLIT)
def test_a_layout_whose_pages_are_not_one_run_is_a_config_error_naming_layer_and_layout(
    server: ServeProcess, layout: KVCacheLayout, spec: str
) -> None:
    views = _allocate(_plan(layout, SPECS[spec]), layout)
    side, core = _side(server, spec, layout, {"namespace": f"{layout.name}-{spec}"}, saves=True)
    try:
        with pytest.raises(ConfigError) as refused:
            side.register(views)
        message = str(refused.value)
        assert any(name in message for name in NAMES), message
        assert layout.name in message and "not one run of bytes" in message, message
        assert core.attached is None
    finally:
        side.close()
        core.close()


@pytest.mark.parametrize(("layout", "spec"), OUTERMOST)
def test_a_block_outermost_cache_moves_one_segment_per_block(
    server: ServeProcess, layout: KVCacheLayout, spec: str
) -> None:
    """All layers in one allocation with the block outermost: a block is every layer's
    page side by side, one run of ``LAYERS`` pages, and the core moves it as one (padded
    pages are not side by side: a segment per layer, the padding never moved)."""
    plan = _plan(layout, SPECS[spec])
    (tensor,) = plan.kv_cache_tensors
    page = SPECS[spec].page_size_bytes
    assert (tensor.layer_stride, tensor.block_stride) == (page, page * LAYERS)
    side, core = _side(server, spec, layout, {"namespace": f"{layout.name}-{spec}"}, saves=True)
    try:
        side.register(_allocate(plan, layout))
        assert core.attached is not None
        assert core.attached.block_bytes == _kv_bytes(SPECS[spec]) * LAYERS
        padded = _kv_bytes(SPECS[spec]) != page
        assert len(core.attached.segment_buffer) == (LAYERS if padded else 1)
    finally:
        side.close()
        core.close()


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC])
def test_kernel_blocks_smaller_than_vllms_block_round_trip(
    server: ServeProcess, layout: KVCacheLayout
) -> None:
    """A backend that takes smaller blocks than vLLM's (``--block-size 32`` with a
    kernel of 16, say): vLLM cuts each block into kernel blocks side by side, and the views'
    first axis counts kernel blocks; a kvbridge block is still vLLM's."""
    spec, kernel = "full-8h-bf16", TOKENS // 2
    plan = _plan(layout, SPECS[spec])
    source, target = (
        allocate_kv_cache(plan, torch.device("cpu"), layout, kernel_block_sizes=[kernel])
        for _ in range(2)
    )
    assert next(iter(source.values())).shape[0] == 2 * BLOCKS
    _fill(source, seed=9)
    extra = {"namespace": f"kernel-{layout.name}"}
    _save_then_load(server, spec, layout, extra, source=source, target=target)
    for name in NAMES:
        for saved, loaded in zip(SAVED, LOADED, strict=True):
            for half in (0, 1):
                got = _page(target[name], 2 * loaded + half)
                assert got == _page(source[name], 2 * saved + half), (name, loaded)
