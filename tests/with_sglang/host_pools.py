"""Host KV pools that carry SGLang's own page code.

SGLang's host pools cannot be imported here: their package imports the GPU runtime (CUDA
kernels, tvm_ffi, flashinfer, transformers). The KV pools allocate their ``kv_buffer``
with the shapes of SGLang's ``init_kv_buffer`` and take every method a storage backend or
the cache controller calls on a pool (``get_page_buffer_meta``, ``get_data_page``,
``get_dummy_flat_data_page``, ``set_from_flat_data_page``) from the installed sglang's
source, unchanged: the text of those methods is read from its ``pool_host/mha.py`` and
``pool_host/mla.py`` and compiled here. ``MambaPool`` is SGLang's whole
``MambaPoolHost`` class (``pool_host/mamba.py``), compiled here over a stand-in for its
base class, and built on CPU state tensors as a hybrid model's Mamba device pool gives
them.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import defaultdict
from collections.abc import Sequence
from functools import wraps
from typing import Any, Optional

import numpy as np
import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang_source import compiled

_CALLED = (
    "get_page_buffer_meta",
    "get_data_page",
    "get_dummy_flat_data_page",
    "set_from_flat_data_page",
)


class _Pool:
    """What every SGLang host pool has that a backend reads."""

    dcp_size = 1
    dcp_rank = 0
    storage_format_tag: str | None = None
    device = "cpu"
    pin_memory = False

    def __init__(self, layout: str, page_size: int, pages: int, layers: int, dtype: Any) -> None:
        self.layout = layout
        self.page_size = page_size
        self.page_num = pages
        self.size = pages * page_size
        self.layer_num = layers
        self.start_layer, self.end_layer = 0, layers
        self.dtype = dtype

    @property
    def logical_page_size(self) -> int:
        return self.page_size * self.dcp_size

    @property
    def logical_size(self) -> int:
        return self.size * self.dcp_size

    def fill(self, seed: int) -> None:
        """Random bytes everywhere (every dtype: raw bytes, never numbers)."""
        flat = self.kv_buffer.view(-1).view(torch.uint8)
        draw = torch.Generator().manual_seed(seed)
        flat.copy_(torch.randint(0, 256, flat.shape, generator=draw).to(torch.uint8))

    def page_bytes(self, index: int) -> bytes:
        """The bytes of the page that starts at host slot ``index``, as SGLang reads them."""
        page = self.get_data_page(index, flat=True)
        return bytes(page.contiguous().view(torch.uint8).numpy())

    def slots(self, *pages: int) -> torch.Tensor:
        """Host indices of whole pages, in the given order."""
        return torch.cat(
            [torch.arange(p * self.page_size, (p + 1) * self.page_size) for p in pages]
        ).to(torch.int64)

    kv_buffer: torch.Tensor
    # SGLang's methods, set below
    get_data_page: Any
    get_page_buffer_meta: Any
    get_dummy_flat_data_page: Any
    set_from_flat_data_page: Any


class MHAPool(_Pool):
    """``MHATokenToKVPoolHost``: K and V of every layer."""

    def __init__(
        self,
        layout: str = "page_first",
        *,
        page_size: int = 4,
        pages: int = 16,
        layers: int = 4,
        heads: int = 2,
        head_dim: int = 64,
        dtype: Any = torch.bfloat16,
    ) -> None:
        super().__init__(layout, page_size, pages, layers, dtype)
        self.head_num, self.head_dim, self.v_head_dim = heads, head_dim, head_dim
        dims = {
            "layer_first": (2, layers, self.size, heads, head_dim),
            "page_first": (2, self.size, layers, heads, head_dim),
            "page_first_direct": (2, pages, layers, page_size, heads, head_dim),
            "page_head": (2, pages, heads, page_size, layers, head_dim),
        }[layout]
        self.kv_buffer = torch.zeros(dims, dtype=dtype)


class MLAPool(_Pool):
    """``MLATokenToKVPoolHost``: one latent vector per token and layer."""

    def __init__(
        self,
        layout: str = "page_first",
        *,
        page_size: int = 4,
        pages: int = 16,
        layers: int = 4,
        kv_cache_dim: int = 128,
        dtype: Any = torch.bfloat16,
    ) -> None:
        super().__init__(layout, page_size, pages, layers, dtype)
        self.kv_cache_dim = kv_cache_dim
        dims = {
            "layer_first": (layers, self.size, 1, kv_cache_dim),
            "page_first": (self.size, layers, 1, kv_cache_dim),
            "page_first_direct": (pages, layers, page_size, 1, kv_cache_dim),
        }[layout]
        self.kv_buffer = torch.zeros(dims, dtype=dtype)


_MHA = "sglang.srt.mem_cache.pool_host.mha"
for _name, _method in compiled(
    _MHA, _CALLED, {"torch": torch}, within="MHATokenToKVPoolHost"
).items():
    setattr(MHAPool, _name, _method)
_MLA = "sglang.srt.mem_cache.pool_host.mla"
_MLA_CALLED = (*_CALLED, "_storage_page_index")
for _name, _method in compiled(
    _MLA, _MLA_CALLED, {"torch": torch}, within="MLATokenToKVPoolHost"
).items():
    setattr(MLAPool, _name, _method)


class HostKVCache:
    """Stands in for SGLang's ``HostKVCache``, ``MambaPoolHost``'s base (its module imports
    the GPU runtime): ``MambaPoolHost`` defines every method that a backend or the
    controller's storage paths call on it."""


_MAMBA = "sglang.srt.mem_cache.pool_host.mamba"
_mamba_scope: dict[str, Any] = {
    "torch": torch,
    "np": np,
    "os": os,
    "threading": threading,
    "Optional": Optional,
    "Sequence": Sequence,
    "logger": logging.getLogger(_MAMBA),
    "MambaStateBufferInfo": MambaStateBufferInfo,
    "HostKVCache": HostKVCache,
    "_is_xpu": False,
    "_is_npu": False,
    "_NPU_HICACHE_MAMBA_IO_ENV": "SGLANG_NPU_HICACHE_MAMBA_IO",
    "_NPU_HICACHE_MAMBA_IO_MODES": {"sync", "async"},
    "transfer_state_per_layer_direct_pf_lf": None,
    "transfer_state_all_layer_direct_lf_pf": None,
    # the host memory a machine has and a PP group's agreement: all of it, this rank's
    "host_memory_budget_bytes": lambda requested, **_: requested,
    "sync_fixed_hicache_size": lambda size, host_size: size,
    "get_allocator_from_storage": lambda allocator_type: None,
    "wraps": wraps,
}
compiled("sglang.srt.mem_cache.pool_host.base", ("synchronized",), _mamba_scope)
compiled("sglang.srt.mem_cache.pool_host.common", ("alloc_with_pin_memory",), _mamba_scope)
# SGLang's CPU allocation maps fresh pages (alloc_mmap); torch.empty gives the same tensors
_mamba_scope["ALLOC_MEMORY_FUNCS"] = defaultdict(lambda: _mamba_scope["alloc_with_pin_memory"])
compiled(_MAMBA, ("_npu_hicache_mamba_io_mode", "MambaPoolHost"), _mamba_scope)
MambaPoolHost: Any = _mamba_scope["MambaPoolHost"]


def mamba_pool(
    *,
    device_slots: int = 4,
    layers: int = 2,
    heads: int = 2,
    state_dim: int = 16,
    conv_dim: int = 64,
    conv_kernel: int = 4,
    layout: str = "page_first",
) -> Any:
    """SGLang's ``MambaPoolHost`` for a device pool of ``device_slots`` states (twice as
    many host slots, plus SGLang's one spare): per layer and slot a float32 temporal state
    (heads x state_dim x state_dim) and a bfloat16 conv state (conv_dim x conv_kernel-1),
    as a gated-delta-net layer keeps them."""
    temporal = torch.zeros((layers, device_slots, heads, state_dim, state_dim))
    conv = torch.zeros((layers, device_slots, conv_dim, conv_kernel - 1), dtype=torch.bfloat16)
    info = MambaStateBufferInfo(temporal=temporal, conv=(conv,))
    return MambaPoolHost(
        info,
        2.0,
        0,
        device_capacity=device_slots,
        pin_memory=False,
        device="cpu",
        layout=layout,
    )


def fill_mamba(pool: Any, seed: int) -> None:
    """Random bytes in every state slot of a ``MambaPoolHost``."""
    draw = torch.Generator().manual_seed(seed)
    for buffer in (pool.temporal_buffer, *pool.conv_buffer):
        flat = buffer.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, generator=draw).to(torch.uint8))


def state_bytes(pool: Any, slot: int) -> bytes:
    """The state at host slot ``slot``, as SGLang reads it (its flat page)."""
    return bytes(pool.get_data_page(slot, flat=True).numpy())
