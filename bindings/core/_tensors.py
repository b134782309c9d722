"""An engine's KV cache tensors (torch) as kvbridge pages, without a copy and without cupy:
a CPU tensor is viewed as a numpy array, a CUDA tensor stays a torch tensor (the staging
path moves its pages with torch; the direct path registers it over UCX). Layouts: the block
first (vLLM 0.32's ``[B, H, N, C]`` views of every layout, and MLA caches), or K and V
first (``(2, num_blocks, block_size, kv_heads, head_dim)``: two pages a layer)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...store import ConfigError
from ._pages import LayoutError, pages_of

__all__ = ["tensor_pages"]

_DEVICES = ("cpu", "cuda")
"""Where the connector can move a KV cache from: host memory, and CUDA memory (staged
through pinned host memory by torch, or directly over UCX)."""


def tensor_pages(name: str, tensor: Any, page_bytes: int, layout: str = "") -> tuple[Any, ...]:
    """One layer's cache as pages of ``page_bytes`` (vLLM's page: a block's K and V): one
    ``(blocks, page_bytes)`` array where the block is the first axis (vLLM 0.32's
    ``[B, H, N, C]`` views, in any ``KVCacheLayout`` whose block is one run of bytes), two
    of half a page where K and V come first (the ``(2, num_blocks, block_size, kv_heads,
    head_dim)`` of vLLM before 0.32). ``layout`` names the engine's layout in errors."""
    device = tensor.device.type
    if device not in _DEVICES:
        raise ConfigError(
            f"kvbridge: layer {name} is on {tensor.device}; kvbridge moves KV caches in "
            f"{' or '.join(_DEVICES)} memory only",
            setting="kv_caches",
        )
    raw = _as_bytes(tensor)
    shape = tuple(int(n) for n in raw.shape)
    try:
        inner = math.prod(shape[1:])
        if inner == page_bytes:
            return (pages_of(raw, name),)
        split = page_bytes // inner if inner and page_bytes % inner == 0 else 0
        if split > 1 and shape[0] % split == 0:  # kernel blocks: a block cut in `split`
            return (pages_of(_grouped(raw, split), name),)
        if len(shape) > 2 and shape[0] == 2 and 2 * math.prod(shape[2:]) == page_bytes:
            return (pages_of(raw[0], f"{name} (K)"), pages_of(raw[1], f"{name} (V)"))
    except LayoutError as exc:
        where = f" (KV cache layout {layout})" if layout else ""
        raise ConfigError(f"kvbridge: {exc}{where}", setting="kv_caches") from None
    raise ConfigError(
        f"kvbridge: layer {name} has shape {tuple(tensor.shape)} ({tensor.dtype}), whose "
        f"blocks are not pages of {page_bytes} bytes (the block first, or K and V first)",
        setting="kv_caches",
    )


def _grouped(raw: Any, split: int) -> Any:
    """``raw``'s first axis of kernel blocks as ``(blocks, split, ...)`` (no copy): vLLM
    cuts a block into ``split`` kernel blocks for a backend that takes smaller ones, which
    it lays side by side (``create_kv_cache_views`` refuses otherwise); ``pages_of`` then
    checks that they are."""
    shape = (raw.shape[0] // split, split, *raw.shape[1:])
    if callable(getattr(raw, "as_strided", None)):  # a torch tensor (its strides: bytes)
        strides = tuple(int(n) for n in raw.stride())
        return raw.as_strided(shape, (strides[0] * split, *strides))
    strides = tuple(int(n) for n in raw.strides)
    return np.lib.stride_tricks.as_strided(raw, shape, (strides[0] * split, *strides))


def _as_bytes(tensor: Any) -> Any:
    """A layer's cache as a uint8 array over the same memory (never viewed as its dtype:
    numpy has no bfloat16): numpy for a CPU tensor, the torch tensor itself for a CUDA one
    (torch moves its pages; no cupy needed)."""
    raw = tensor.view(_uint8(tensor))
    return raw.numpy() if raw.device.type == "cpu" else raw


def _uint8(tensor: Any) -> Any:
    import torch  # noqa: PLC0415  (present wherever vLLM is)

    return torch.uint8
