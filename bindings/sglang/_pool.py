"""SGLang's host KV pool (``HostKVCache``) as kvbridge sees it: a :class:`PageLayout`.

kvbridge never reads SGLang's layout code: it asks the pool, as SGLang's zero-copy
backends do, where a page's bytes are (``get_page_buffer_meta(host_indices)`` -> one
pointer and size per segment: K and V of a page for MHA ``page_first``, K and V per layer
for ``layer_first``, one for MLA). One kvbridge block is one SGLang page: its segments in
the pool's order, all of one size. Pointers become offsets into the pool's buffers,
registered once; every offset is checked against its buffer before a byte moves.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...store import ConfigError
from ...store.server import MIN_BLOCK_BYTES
from ..core._pages import LayoutError


class HostPages:
    """The pages of one host pool, named by SGLang's host indices (token slots)."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self.page_tokens = int(pool.page_size)
        self.capacity = int(pool.size)
        """Token slots in the pool."""
        tensors = _pool_tensors(pool)
        self._buffers = tuple(_bytes_of(t, "the host pool's buffer") for t in tensors)
        self._bases = np.array([int(t.data_ptr()) for t in tensors], dtype=np.int64)
        first = torch.arange(self.page_tokens, dtype=torch.int64)
        pointers, sizes = pool.get_page_buffer_meta(first)
        if not pointers or len(pointers) != len(sizes):
            raise LayoutError("the host pool describes no page memory")
        if len(set(sizes)) != 1:
            raise LayoutError(
                f"a page's segments differ in size ({sorted(set(sizes))} bytes): this host "
                "pool layout is not supported (use page_first or layer_first)"
            )
        self.segment_bytes = int(sizes[0])
        self._segment_buffer = tuple(self._owner(int(p)) for p in pointers)
        self._limits = np.array(
            [self._buffers[b].nbytes - self.segment_bytes for b in self._segment_buffer],
            dtype=np.int64,
        )

    @property
    def buffers(self) -> tuple[Any, ...]:
        return self._buffers

    @property
    def segment_buffer(self) -> tuple[int, ...]:
        return self._segment_buffer

    @property
    def segment_rows(self) -> tuple[tuple[int, int], ...]:
        """Rows of one segment each from each buffer's start (SGLang's pages are whole
        segments apart)."""
        return ((0, self.segment_bytes),) * self.segments

    @property
    def segments(self) -> int:
        return len(self._segment_buffer)

    @property
    def block_bytes(self) -> int:
        return self.segments * self.segment_bytes

    def offsets(self, at: Any) -> np.ndarray:
        """``at``: host indices, ``page_tokens`` per page. Shape ``(pages, segments)``."""
        slots = whole_pages(at, self.page_tokens, self.capacity)
        count = slots.size // self.page_tokens
        if count == 0:
            return np.zeros((0, self.segments), dtype=np.int64)
        pointers, sizes = self._pool.get_page_buffer_meta(torch.from_numpy(slots))
        if len(pointers) != count * self.segments or set(sizes) != {self.segment_bytes}:
            raise LayoutError("the host pool described these pages unlike its first page")
        where = np.asarray(pointers, dtype=np.int64).reshape(count, self.segments)
        offsets = where - self._bases[list(self._segment_buffer)]
        if (offsets < 0).any() or (offsets > self._limits).any():
            raise LayoutError("a page's memory lies outside the host pool's buffers")
        return offsets

    def _owner(self, pointer: int) -> int:
        for i, (base, buffer) in enumerate(zip(self._bases, self._buffers, strict=True)):
            if base <= pointer < base + buffer.nbytes:
                return i
        raise LayoutError("a page's memory lies outside the host pool's buffers")


def check_page_bytes(pool: str, nbytes: int) -> None:
    """Raises :class:`ConfigError` when the ``pool`` pool's pages, as kvbridge stores them,
    are smaller than a cache server's smallest block (SGLang starts, saying so, instead
    of running with a store that refuses every page)."""
    if nbytes < MIN_BLOCK_BYTES:
        raise ConfigError(
            f"kvbridge: the {pool} host pool's pages are {nbytes} bytes, under a cache "
            f"server's smallest block ({MIN_BLOCK_BYTES} bytes), which kvbridge cannot store "
            "(a larger --page-size makes larger KV pages)"
        )


def whole_pages(host_indices: Any, page_tokens: int, capacity: int) -> np.ndarray:
    """``host_indices`` as checked slots; raises :class:`LayoutError` unless they are runs
    of ``page_tokens`` slots, each starting on a page, inside a pool of ``capacity``
    slots, no page twice."""
    slots = _as_slots(host_indices)
    if slots.size % page_tokens:
        raise LayoutError(f"{slots.size} host slots are not whole pages of {page_tokens} tokens")
    if slots.size and (slots.min() < 0 or slots.max() >= capacity):
        raise LayoutError(f"host slots outside the pool's {capacity} slots")
    runs = slots.reshape(-1, page_tokens)
    starts = runs[:, :1]
    scattered = (runs - starts != np.arange(page_tokens)).any()
    if scattered or (starts % page_tokens).any():
        raise LayoutError("host slots are not whole pages (a page's slots must be one run)")
    if len(np.unique(starts)) != len(runs):
        raise LayoutError("a page is named twice in one call")
    return slots


def flat_bytes(tensor: Any, nbytes: int, *, writable: bool) -> np.ndarray:
    """A flat page tensor of SGLang's copying interface as ``nbytes`` bytes: a view of it
    (``writable``: the bytes land in the tensor itself) or, to read from, of a contiguous
    copy when it is strided."""
    if not isinstance(tensor, torch.Tensor):
        raise LayoutError(f"a page must be a tensor, got {type(tensor).__name__}")
    if tensor.nbytes != nbytes:
        raise LayoutError(f"a page is {nbytes} bytes, this tensor {tensor.nbytes}")
    if not writable:
        tensor = tensor.contiguous()
    return _bytes_of(tensor, "a page tensor")


def _pool_tensors(pool: Any) -> list[Any]:
    """The tensors a pool keeps its pages in: ``kv_buffer``, or its parts when it is a
    list (several buffers)."""
    held = getattr(pool, "kv_buffer", None)
    tensors = list(held) if isinstance(held, list | tuple) else [held]
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise LayoutError(
            f"the host pool ({type(pool).__name__}) has no kv_buffer tensor: it keeps no "
            "pages of its own (an allocator-only pool), and kvbridge stores pages"
        )
    return tensors


def _bytes_of(tensor: Any, what: str) -> np.ndarray:
    """A flat uint8 numpy view of a contiguous CPU tensor (no copy; numpy has no bfloat16,
    so the tensor is viewed as bytes first)."""
    if tensor.device.type != "cpu":
        raise LayoutError(f"{what} is in {tensor.device.type} memory, not host memory")
    if not tensor.is_contiguous():
        raise LayoutError(f"{what} is not one run of bytes")
    flat: np.ndarray = tensor.reshape(-1).view(torch.uint8).numpy()
    return flat


def _as_slots(host_indices: Any) -> np.ndarray:
    try:
        if isinstance(host_indices, torch.Tensor):
            host_indices = host_indices.detach().cpu().numpy()
        slots = np.asarray(host_indices)
    except (TypeError, ValueError, RuntimeError, NotImplementedError) as exc:
        raise LayoutError(f"host indices: {exc}") from None
    if slots.ndim != 1 or not np.issubdtype(slots.dtype, np.integer):
        raise LayoutError(
            f"host indices must be one row of integers, got {slots.dtype}{slots.shape}"
        )
    return slots.astype(np.int64, copy=False)
