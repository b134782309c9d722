"""vLLM 0.32's KV cache as its GPU worker allocates it and hands it to a connector's
``register_kv_caches``, built with plain ``torch.as_strided`` (vLLM is not installed where
the GPU tests run): ONE raw int8 allocation for every layer, and per layer a 4-D
``[B, H, N, C]`` view of it (B blocks, H KV heads, N tokens of a block, C the bytes of one
token of one head: K and V, ``2 * head_dim`` elements; MLA's latent, one head), viewed as
the cache's dtype, the five logical axes ``[L, B, H, N, C]`` lying in memory in the order
a :data:`LAYOUTS` entry gives.

What it mirrors, for one KV cache group of one spec (no padded pages, no kernel blocks
smaller than the block, no hybrid groups):

- ``vllm/v1/kv_cache_layout.py``: ``KVCacheLayout``, each member the physical order of the
  logical axes (:data:`LAYOUTS` copies the values);
- ``vllm/v1/kv_cache_interface.py``: ``compute_layer_kv_cache_shape_bytes`` (:class:`Spec`),
  ``compute_layout_strides`` (:func:`byte_strides`) and ``create_kv_cache_views`` (the
  raw buffer ``as_strided`` to ``[L, B, H, N, C]``, a layer taken, then ``.view(dtype)``:
  :func:`allocate`);
- ``vllm/v1/core/kv_cache_utils.py``: ``get_kv_cache_config_from_groups`` (one
  ``KVCacheTensor`` for the group: the allocation's size, a layer's and a block's stride);
- ``vllm/v1/worker/utils.py``: ``allocate_kv_cache`` (``torch.zeros(size, dtype=torch.int8)``,
  the one buffer every layer's view cuts into).

Which layout a GPU gets: the engine core's ``resolve_kv_cache_layout``
(``vllm/v1/attention/backends/utils.py``) takes the first layout every attention backend
supports (``get_supported_kv_cache_layouts``) unless ``VLLM_KV_CACHE_LAYOUT`` or the
connector's ``get_required_kvcache_layout`` names another. ``FlashAttentionBackend``, what
vLLM runs on an H100 or H200, declares no ``supported_kv_cache_layouts``, so the default
preference (``_DEFAULT_LAYOUT_PREFERENCE``) decides: LBNHC. FlashInfer on compute
capability 10 (Blackwell) declares (LBHNC, BLHNC).

``tests/test_vllm_views.py`` checks the strides everywhere, and the views against vLLM's
own ``allocate_kv_cache`` where vLLM is installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["LAYOUTS", "KVCache", "Spec", "allocate", "blocks_of", "byte_strides", "layer_name"]

LAYOUTS: dict[str, tuple[int, int, int, int, int]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
"""``KVCacheLayout``'s members: the logical axes ``[L, B, H, N, C]`` (0 to 4), outermost in
memory first. LBNHC is a layer's blocks side by side, each block's tokens outside its heads
(FlashAttention's NHD); BLHNC is a block's pages of every layer side by side."""


@dataclass(frozen=True)
class Spec:
    """One layer's ``[B, H, N, C]`` in bytes (``compute_layer_kv_cache_shape_bytes``):
    ``blocks`` blocks of ``heads`` x ``block_size`` tokens x ``content`` bytes."""

    blocks: int
    heads: int
    block_size: int
    content: int

    @classmethod
    def attention(
        cls, blocks: int, heads: int, block_size: int, head_dim: int, itemsize: int
    ) -> Spec:
        """Full attention (``AttentionSpec``): a token's K and V of a head side by side."""
        return cls(blocks, heads, block_size, 2 * head_dim * itemsize)

    @classmethod
    def mla(cls, blocks: int, block_size: int, latent: int, itemsize: int) -> Spec:
        """MLA (``MLAAttentionSpec``: one head, no V): a token's latent and RoPE dims."""
        return cls(blocks, 1, block_size, latent * itemsize)

    @property
    def page(self) -> int:
        """The bytes of one (layer, block): vLLM's ``page_size_bytes``."""
        return self.heads * self.block_size * self.content


def byte_strides(layout: str, spec: Spec, layers: int) -> tuple[int, int, int, int, int]:
    """The byte strides of the logical ``[L, B, H, N, C]`` (``compute_layout_strides``
    without padding): the innermost axis in ``LAYOUTS[layout]`` moves one byte, each
    other one the size of everything inside it."""
    shape = (layers, spec.blocks, spec.heads, spec.block_size, spec.content)
    strides = [0] * 5
    step = 1
    for axis in reversed(LAYOUTS[layout]):
        strides[axis] = step
        step *= shape[axis]
    return strides[0], strides[1], strides[2], strides[3], strides[4]


def layer_name(index: int) -> str:
    """A layer's name as vLLM's model runner keys ``kv_caches`` (Llama's)."""
    return f"model.layers.{index}.self_attn.attn"


@dataclass(frozen=True)
class KVCache:
    """The cache: ``raw``, the one int8 allocation, and per layer name its ``[B, H, N, C]``
    view in the cache's dtype (what ``register_kv_caches`` receives)."""

    raw: Any
    layers: dict[str, Any]
    spec: Spec
    layout: str


def allocate(layout: str, spec: Spec, layers: int, dtype: Any, device: str = "cpu") -> KVCache:
    """A zeroed cache of ``layers`` layers of ``spec`` in ``layout``, as
    ``allocate_kv_cache`` makes it: ``torch.zeros(size, int8)``, then per layer
    ``as_strided(raw, [L, B, H, N, C], strides)[layer].view(dtype)``."""
    import torch  # noqa: PLC0415  (only the tests that build a cache need torch)

    size = layers * spec.blocks * spec.page
    raw = torch.zeros(size, dtype=torch.int8, device=device)
    logical = torch.as_strided(
        raw,
        size=(layers, spec.blocks, spec.heads, spec.block_size, spec.content),
        stride=byte_strides(layout, spec, layers),
    )
    views = {layer_name(i): logical[i].view(dtype) for i in range(layers)}
    return KVCache(raw, views, spec, layout)


def blocks_of(cache: KVCache, ids: Sequence[int]) -> Any:
    """Blocks ``ids`` of every layer as the views hold them, copied to the host on the
    current stream: uint8, ``(len(ids), layers, H, N, C)``."""
    import torch  # noqa: PLC0415

    index = torch.as_tensor(list(ids), dtype=torch.long, device=cache.raw.device)
    pages = [view.view(torch.uint8)[index] for view in cache.layers.values()]
    return torch.stack(pages, dim=1).cpu()
