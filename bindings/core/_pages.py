"""An engine's paged KV cache as kvbridge sees it: per layer, an array of pages.

A page is one (layer, block) of the engine's cache: opaque bytes, never reinterpreted
(inside a page, vLLM's CPU backend keeps all K rows of a head before its V rows, the GPU
backends interleave them per token; moving whole pages as bytes is right for both). One
kvbridge block is one engine block across all layers: ``layers`` pages, in layer order.

Any engine memory that a connector moves blocks of is a :class:`PageLayout`: buffers to
register once, and for a batch of blocks where each of their equal segments lies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
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
class PagedKV:
    """The KV cache: ``pages[layer]`` is a ``(blocks, page_bytes)`` uint8 array (numpy, or
    cupy for GPU memory) viewing the engine's own memory (no copy)."""

    pages: tuple[Any, ...]
    descriptor: str
    """What the bytes of a page mean (dtype, page shape, device), for messages and logs;
    the namespace is the engine adapter's :class:`~kvbridge.bindings.Identity`."""

    def __post_init__(self) -> None:
        if not self.pages:
            raise LayoutError("the KV cache has no layers")
        shapes = {tuple(p.shape) for p in self.pages}
        if len(shapes) != 1 or len(next(iter(shapes))) != 2:
            raise LayoutError(f"layers disagree on (blocks, page bytes): {sorted(shapes)}")
        if {is_device(p) for p in self.pages} != {is_device(self.pages[0])}:
            raise LayoutError("some layers are in GPU memory and some are not")

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
        return self.pages

    @property
    def segment_buffer(self) -> tuple[int, ...]:
        return tuple(range(self.layers))

    def offsets(self, at: Any) -> np.ndarray:
        """``at``: block ids; a block's page in every layer is at ``id * page_bytes``."""
        ids = self.check(at)
        return np.repeat((ids * self.page_bytes)[:, None], self.layers, axis=1)

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


def pages_of(layer: Any, name: str) -> Any:
    """A ``(blocks, page_bytes)`` uint8 view of one layer's cache, given as a uint8 array
    whose first axis is the block (numpy, cupy, or a torch tensor: the engine adapter makes
    it from its tensor). Raises :class:`LayoutError` when a block is not one contiguous run
    of bytes."""
    blocks = int(layer.shape[0])
    page = int(np.prod(layer.shape[1:])) if layer.ndim > 1 else 1
    inner = _contiguous_strides(layer.shape[1:])
    strides = _byte_strides(layer)
    if strides[1:] != inner or strides[0] < page:
        raise LayoutError(
            f"layer {name}: a block is not one run of bytes (shape {tuple(layer.shape)}, "
            f"byte strides {strides})"
        )
    if callable(getattr(layer, "as_strided", None)):  # a torch tensor
        return layer.as_strided((blocks, page), (strides[0], 1))
    xp = _array_module(layer)
    return xp.lib.stride_tricks.as_strided(layer, (blocks, page), (strides[0], 1))


def _byte_strides(layer: Any) -> tuple[int, ...]:
    """A uint8 array's strides (torch counts them in elements, which are bytes here)."""
    if callable(getattr(layer, "stride", None)):  # a torch tensor
        return tuple(int(s) for s in layer.stride())
    return tuple(int(s) for s in layer.strides)


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= int(extent)
    return tuple(reversed(strides))


def _array_module(array: Any) -> Any:
    if is_device(array):
        import cupy  # noqa: PLC0415  (only where GPU memory is in use)

        return cupy
    return np
