"""``tests/vllm_views.py``, the KV cache as vLLM 0.32's GPU worker makes it (built without
vLLM, for the GPU tests): the byte strides of its layouts on every machine; with torch,
views of one allocation; and where vLLM is installed, the same views as vLLM's own
``allocate_kv_cache`` after ``get_kv_cache_config_from_groups``, for every layout, and
FlashAttention's pick (LBNHC). Run the vLLM part with
``.venv-vllm/bin/python -m pytest tests/test_vllm_views.py -p no:cacheprovider``."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from vllm_views import LAYOUTS, Spec, allocate, blocks_of, byte_strides, layer_name

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not installed"
)
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (run with .venv-vllm/bin/python)",
)

BLOCKS, TOKENS, LAYERS = 5, 16, 3
SPEC = Spec(blocks=BLOCKS, heads=2, block_size=TOKENS, content=512)
PAGE = 2 * TOKENS * 512  # 16 KiB: a (layer, block)


def test_strides_of_the_layouts_a_gpu_gets() -> None:
    """``[L, B, H, N, C]`` byte strides: a layer's blocks a page apart in the layer-outermost
    layouts (tokens outside heads in LBNHC, heads outside tokens in LBHNC), a block's
    pages of every layer side by side in BLHNC."""
    assert SPEC.page == PAGE
    assert byte_strides("LBHNC", SPEC, LAYERS) == (BLOCKS * PAGE, PAGE, TOKENS * 512, 512, 1)
    assert byte_strides("LBNHC", SPEC, LAYERS) == (BLOCKS * PAGE, PAGE, 512, 2 * 512, 1)
    assert byte_strides("BLHNC", SPEC, LAYERS) == (PAGE, LAYERS * PAGE, TOKENS * 512, 512, 1)


def test_content_of_attention_and_mla() -> None:
    assert Spec.attention(BLOCKS, 8, TOKENS, 128, 2) == Spec(BLOCKS, 8, TOKENS, 512)
    assert Spec.mla(BLOCKS, TOKENS, 576, 1) == Spec(BLOCKS, 1, TOKENS, 576)


@needs_torch
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLHNC"])
def test_every_layer_is_a_view_of_one_allocation(layout: str) -> None:
    import torch  # noqa: PLC0415

    cache = allocate(layout, SPEC, LAYERS, torch.bfloat16)
    layer_stride, block_stride, *_ = byte_strides(layout, SPEC, LAYERS)
    for i, view in enumerate(cache.layers.values()):
        assert view.shape == (BLOCKS, 2, TOKENS, 256)  # 512 bytes: 256 bf16
        assert view.untyped_storage().data_ptr() == cache.raw.untyped_storage().data_ptr()
        assert view.data_ptr() - cache.raw.data_ptr() == i * layer_stride
        view.view(torch.uint8)[3] = i + 1  # a page is one run of bytes in these layouts
        start = i * layer_stride + 3 * block_stride
        assert bool((cache.raw[start : start + PAGE] == i + 1).all())
    assert cache.raw.count_nonzero() == LAYERS * PAGE
    assert blocks_of(cache, [3]).shape == (1, LAYERS, 2, TOKENS, 512)


@needs_vllm
def test_flash_attention_gets_lbnhc() -> None:
    """What an H100 or H200 runs: FlashAttention declares no layouts, and the default
    preference puts LBNHC first (``get_supported_kv_cache_layouts``)."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend  # noqa: PLC0415
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts  # noqa: PLC0415

    assert FlashAttentionBackend.supported_kv_cache_layouts() is None
    assert get_supported_kv_cache_layouts([FlashAttentionBackend])[0].name == "LBNHC"


@needs_vllm
def test_the_layouts_are_vllms() -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: PLC0415

    assert {m.name: m.value for m in KVCacheLayout} == LAYOUTS


def _vllm_views(layout: str, spec: Any) -> dict[str, Any]:
    """vLLM's own KV cache for ``LAYERS`` layers of ``spec`` in ``BLOCKS`` blocks: the
    engine core's plan once the layout is resolved, then the worker's allocation."""
    import torch  # noqa: PLC0415
    from vllm.config import CacheConfig, VllmConfig  # noqa: PLC0415
    from vllm.v1.attention.backends.utils import record_kv_cache_layout  # noqa: PLC0415
    from vllm.v1.core.kv_cache_utils import (  # noqa: PLC0415
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: PLC0415
    from vllm.v1.worker.utils import allocate_kv_cache  # noqa: PLC0415

    config = VllmConfig(cache_config=CacheConfig(block_size=TOKENS, num_gpu_blocks_override=BLOCKS))
    record_kv_cache_layout(config.cache_config, layout)
    names = [layer_name(i) for i in range(LAYERS)]
    groups = get_kv_cache_groups(config, dict.fromkeys(names, spec))
    plan = get_kv_cache_config_from_groups(config, groups, 1 << 30)
    assert plan.num_blocks == BLOCKS
    views: dict[str, Any] = allocate_kv_cache(plan, torch.device("cpu"), KVCacheLayout[layout])
    return views


def _vllm_specs() -> dict[str, tuple[Any, Spec]]:
    """vLLM's specs (bf16 and fp8, 8 and 1 KV heads, MLA) and the same as :class:`Spec`."""
    import torch  # noqa: PLC0415
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec  # noqa: PLC0415

    specs: dict[str, tuple[Any, Spec]] = {}
    for heads in (8, 1):
        for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
            size = dtype.itemsize
            specs[f"{heads}h-{name}"] = (
                FullAttentionSpec(
                    block_size=TOKENS, num_kv_heads=heads, head_size=128, dtype=dtype
                ),
                Spec.attention(BLOCKS, heads, TOKENS, 128, size),
            )
    specs["mla-bf16"] = (
        MLAAttentionSpec(block_size=TOKENS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16),
        Spec.mla(BLOCKS, TOKENS, 576, 2),
    )
    return specs


@needs_vllm
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("spec", ["8h-bf16", "1h-bf16", "8h-fp8", "1h-fp8", "mla-bf16"])
def test_views_are_the_ones_vllm_makes(layout: str, spec: str) -> None:
    """Same names, dtype, shape, strides and offsets into an allocation of the same size:
    the bytes a connector sees are where vLLM's kernels put them."""
    theirs_spec, ours_spec = _vllm_specs()[spec]
    theirs = _vllm_views(layout, theirs_spec)
    ours = allocate(layout, ours_spec, LAYERS, theirs_spec.dtype)
    assert ours_spec.page == theirs_spec.page_size_bytes
    assert list(ours.layers) == list(theirs)
    for name, view in ours.layers.items():
        vllm_view = theirs[name]
        assert (view.dtype, view.shape, view.stride()) == (
            vllm_view.dtype,
            vllm_view.shape,
            vllm_view.stride(),
        )
        assert view.storage_offset() == vllm_view.storage_offset()
        assert view.untyped_storage().nbytes() == vllm_view.untyped_storage().nbytes()
