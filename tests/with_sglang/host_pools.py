"""Host KV pools that carry SGLang's own page code.

SGLang's host pools cannot be built here: their modules import the GPU runtime (CUDA
kernels, tvm_ffi, flashinfer). These pools allocate their ``kv_buffer`` with the shapes
of SGLang's ``init_kv_buffer`` and take every method a storage backend or the cache
controller calls on a pool (``get_page_buffer_meta``, ``get_data_page``,
``get_dummy_flat_data_page``, ``set_from_flat_data_page``) from the installed sglang's
source, unchanged: the text of those methods is read from its ``pool_host/mha.py`` and
``pool_host/mla.py`` and compiled here.
"""

from __future__ import annotations

from typing import Any

import torch
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
