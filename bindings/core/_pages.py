"""An engine's paged KV cache as kvbridge sees it: per layer, an array of pages.

A page is one (layer, block) of the engine's cache: opaque bytes, never reinterpreted
(inside a page, vLLM's CPU backend keeps all K rows of a head before its V rows, the GPU
backends interleave them per token; moving whole pages as bytes is right for both). One
kvbridge block is one engine block across all layers: ``layers`` pages, in layer order.

Where the pages lie is the engine's choice. vLLM 0.32 cuts every layer's cache out of one
allocation in one of its ``KVCacheLayout`` s: layer-outermost (a layer's blocks side by
side, a page apart), block-outermost (a block's pages of every layer side by side), with
the axes inside a block in any order, and pages may be padded. Any of these is pages as
long as each (layer, block) is one dense run of bytes (:func:`pages_of` checks it).

Any engine memory that a connector moves blocks of is a :class:`PageLayout`: buffers to
register once, and for a batch of blocks where each of their equal segments lies.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ...transfer import is_device


class LayoutError(ValueError):
    """The engine's KV cache cannot be moved as pages (layers disagree, or a layer's
    blocks are not whole runs of bytes)."""


class PageLayout(Protocol):
    """Where a batch of blocks lies in an engine's memory: each block is ``segments``
    equal parts, part ``s`` in ``buffers[segment_buffer[s]]``."""

    @property
    def buffers(self) -> tuple[Any, ...]:
        """The memory to register, each a C-contiguous uint8 array (numpy or cupy)."""

    @property
    def segment_buffer(self) -> tuple[int, ...]:
        """Per segment, the index in :attr:`buffers` that holds it."""

    @property
    def segment_rows(self) -> tuple[tuple[int, int], ...]:
        """Per segment, ``(first, step)``: every offset of that segment is ``first + r *
        step`` for a row ``r`` (``step`` is the segment's size unless pages are padded or
        interleaved with other segments)."""

    @property
    def block_bytes(self) -> int: ...

    def offsets(self, at: Any) -> np.ndarray:
        """For the blocks at ``at`` (the engine's way of naming them), the byte offset of
        each segment in its buffer, shape ``(blocks, segments)``. Raises
        :class:`LayoutError` for a position outside the memory, changing nothing."""


def check_memory(memory: PageLayout) -> None:
    """Raises :class:`LayoutError` unless every buffer is one run of bytes."""
    for i, buffer in enumerate(memory.buffers):
        if not _contiguous(buffer):
            raise LayoutError(f"buffer {i}: not one run of bytes")


def _contiguous(buffer: Any) -> bool:
    if callable(getattr(buffer, "is_contiguous", None)):  # a torch tensor
        return bool(buffer.is_contiguous())
    flags = getattr(buffer, "flags", None)
    return bool(flags is not None and flags["C_CONTIGUOUS"])


@dataclass(frozen=True)
class _Segment:
    """Where one segment of every block lies: block ``b``'s at ``first + b * step`` in
    buffer ``buffer``."""

    buffer: int
    first: int
    step: int


@dataclass(frozen=True)
class _Plan:
    """The buffers to register and the segments of a block (:func:`_plan`)."""

    buffers: tuple[Any, ...]
    segments: tuple[_Segment, ...]


@dataclass(frozen=True)
class PagedKV:
    """The KV cache: ``pages[layer]`` is a ``(blocks, page_bytes)`` uint8 array (numpy, or
    a torch tensor or cupy array for GPU memory) viewing the engine's own memory (no copy);
    a block's page of a layer is one run of bytes, the blocks any distance apart.

    Layers whose pages lie in one allocation, interleaved (block-outermost layouts), are
    one buffer; if a block's pages of every layer are side by side in layer order there,
    a block is one segment (one run of ``block_bytes``), else a segment per layer."""

    pages: tuple[Any, ...]
    descriptor: str
    """What the bytes of a page mean (dtype, page shape, device), for messages and logs;
    the namespace is the engine adapter's :class:`~kvbridge.bindings.Identity`."""
    _plan: _Plan = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.pages:
            raise LayoutError("the KV cache has no layers")
        shapes = {tuple(p.shape) for p in self.pages}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise LayoutError(f"layers disagree on (blocks, page bytes): {sorted(shapes)}")
        if {is_device(p) for p in self.pages} != {is_device(self.pages[0])}:
            raise LayoutError("some layers are in GPU memory and some are not")
        object.__setattr__(self, "_plan", _plan(self.pages))

    @property
    def layers(self) -> int:
        return len(self.pages)

    @property
    def blocks(self) -> int:
        return int(self.pages[0].shape[0])

    @property
    def page_bytes(self) -> int:
        return int(self.pages[0].shape[1])

    @property
    def block_bytes(self) -> int:
        return self.layers * self.page_bytes

    @property
    def on_device(self) -> bool:
        return is_device(self.pages[0])

    @property
    def buffers(self) -> tuple[Any, ...]:
        return self._plan.buffers

    @property
    def segment_buffer(self) -> tuple[int, ...]:
        return tuple(s.buffer for s in self._plan.segments)

    @property
    def segment_rows(self) -> tuple[tuple[int, int], ...]:
        return tuple((s.first, s.step) for s in self._plan.segments)

    def offsets(self, at: Any) -> np.ndarray:
        """``at``: block ids; segment ``s`` of block ``b`` is at ``first + b * step``."""
        ids = self.check(at)
        firsts = np.array([s.first for s in self._plan.segments], dtype=np.int64)
        steps = np.array([s.step for s in self._plan.segments], dtype=np.int64)
        return firsts[None, :] + ids[:, None] * steps[None, :]

    def check(self, block_ids: Sequence[int]) -> np.ndarray:
        """``block_ids`` as an index array; raises :class:`LayoutError` outside the cache."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() >= self.blocks)):
            raise LayoutError(f"block ids outside the cache's {self.blocks} blocks")
        return ids

    def gather(self, block_ids: Sequence[int]) -> Any:
        """A copy of the blocks, ``(len(block_ids), block_bytes)``, layers side by side."""
        ids = self.check(block_ids)
        xp = _array_module(self.pages[0])
        return xp.concatenate([page[ids] for page in self.pages], axis=1)

    def scatter(self, block_ids: Sequence[int], data: Any) -> None:
        """Write ``gather``-shaped ``data`` into the blocks."""
        ids = self.check(block_ids)
        size = self.page_bytes
        for layer, page in enumerate(self.pages):
            page[ids] = data[:, layer * size : (layer + 1) * size]


def _plan(pages: tuple[Any, ...]) -> _Plan:
    """Layers whose pages' address ranges overlap share a buffer (the span of all of
    them); a block is one segment when every layer is in one buffer, a page after the
    one before, with one block stride."""
    blocks, page = (int(n) for n in pages[0].shape)
    if blocks < 1 or page < 1:
        raise LayoutError(f"the KV cache has {blocks} blocks of {page} bytes")
    starts = [_address(p) for p in pages]
    steps = [_byte_strides(p)[0] if blocks > 1 else page for p in pages]
    ends = [s + (blocks - 1) * step + page for s, step in zip(starts, steps, strict=True)]
    spans = _merge(sorted(zip(starts, ends, strict=True)))
    buffers = tuple(_run(pages[starts.index(lo)], hi - lo) for lo, hi in spans)
    owner = [next(b for b, (lo, hi) in enumerate(spans) if lo <= s < hi) for s in starts]
    for b in range(len(spans)):
        members = [i for i in range(len(pages)) if owner[i] == b]
        _check_apart([starts[i] for i in members], [steps[i] for i in members], page)
    if len(spans) == 1 and all(
        starts[i] == starts[0] + i * page and steps[i] == steps[0] for i in range(len(pages))
    ):
        return _Plan(buffers, (_Segment(0, starts[0] - spans[0][0], steps[0]),))
    return _Plan(
        buffers,
        tuple(
            _Segment(b, start - spans[b][0], step)
            for b, start, step in zip(owner, starts, steps, strict=True)
        ),
    )


def _check_apart(starts: list[int], steps: list[int], page: int) -> None:
    """Raises :class:`LayoutError` when pages of layers that share a buffer (and one block
    stride) overlap: in every block period each layer's page must have ``page`` bytes of
    its own."""
    if len(starts) < 2 or len(set(steps)) != 1:
        return
    step = steps[0]
    places = sorted(start % step for start in starts)
    gaps = [b - a for a, b in itertools.pairwise(places)] + [places[0] + step - places[-1]]
    if min(gaps) < page:
        raise LayoutError(f"pages of different layers overlap ({page}-byte pages, {step} apart)")


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted ``[start, end)`` ranges, overlapping ones merged."""
    merged: list[tuple[int, int]] = []
    for lo, hi in spans:
        if merged and lo < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _run(pages: Any, nbytes: int) -> Any:
    """``nbytes`` of memory from the first byte of ``pages``, as one uint8 run."""
    if callable(getattr(pages, "as_strided", None)):  # a torch tensor
        return pages.as_strided((nbytes,), (1,))
    xp = _array_module(pages)
    return xp.lib.stride_tricks.as_strided(pages, (nbytes,), (1,))


def _address(array: Any) -> int:
    if callable(getattr(array, "data_ptr", None)):  # a torch tensor
        return int(array.data_ptr())
    if is_device(array):  # cupy
        return int(array.data.ptr)
    return int(array.__array_interface__["data"][0])


def pages_of(layer: Any, name: str) -> Any:
    """A ``(blocks, page_bytes)`` uint8 view of one layer's cache, given as a uint8 array
    whose first axis is the block (numpy, cupy, or a torch tensor: the engine adapter makes
    it from its tensor). A block's axes may lie in any order, as long as its bytes are one
    dense run; raises :class:`LayoutError` when they are not."""
    blocks = int(layer.shape[0])
    page = int(np.prod(layer.shape[1:])) if layer.ndim > 1 else 1
    strides = _byte_strides(layer)
    if not _dense(layer.shape[1:], strides[1:]) or (blocks > 1 and strides[0] < page):
        raise LayoutError(
            f"layer {name}: a block is not one run of bytes (shape {tuple(layer.shape)}, "
            f"byte strides {strides})"
        )
    step = strides[0] if blocks > 1 else page
    if callable(getattr(layer, "as_strided", None)):  # a torch tensor
        return layer.as_strided((blocks, page), (step, 1))
    xp = _array_module(layer)
    return xp.lib.stride_tricks.as_strided(layer, (blocks, page), (step, 1))


def _dense(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether axes of ``shape`` with byte ``strides`` tile one run of bytes exactly, in
    some order (axes of one element may have any stride)."""
    step = 1
    axes = sorted((int(s), int(n)) for n, s in zip(shape, strides, strict=True) if n != 1)
    for stride, extent in axes:
        if stride != step:
            return False
        step *= extent
    return True


def _byte_strides(layer: Any) -> tuple[int, ...]:
    """A uint8 array's strides (torch counts them in elements, which are bytes here)."""
    if callable(getattr(layer, "stride", None)):  # a torch tensor
        return tuple(int(s) for s in layer.stride())
    return tuple(int(s) for s in layer.strides)


def _array_module(array: Any) -> Any:
    if is_device(array):
        import cupy  # noqa: PLC0415  (only where GPU memory is in use)

        return cupy
    return np
