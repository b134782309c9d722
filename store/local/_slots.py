"""A tier of fixed-size slots over host or device memory, with an O(1) allocator."""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Container, Iterator, Sequence

import numpy as np

from .._buffers import BlockArray, copy_into
from .._checksums import NO_SUM
from .._keys import BlockKey
from ._policy import EvictionPolicy, insert_all
from ._slab import SlotMemory
from ._tier import BlockReader


class SlotTier:
    """Blocks in the slots of one :class:`SlotMemory` (a host slab or a device buffer).

    The free list is a FIFO of slot numbers (O(1) both ends); the index maps each key to
    its slot. ``view(key)`` is the zero-copy view that transfers read from and write to.
    Each slot has its block's end-to-end checksum beside it (``_checksums``; ``NO_SUM``
    until one is set), 8 bytes a slot.
    """

    persistent = False

    def __init__(self, name: str, memory: SlotMemory, policy: EvictionPolicy) -> None:
        self.name = name
        self.memory = memory
        self.block_bytes = memory.block_bytes
        self.capacity = memory.slots
        self.policy = policy
        self._slot_of: dict[BlockKey, int] = {}
        self.index: Container[BlockKey] = self._slot_of
        # Free slots are reused oldest-freed first, lowest first at the start: a batch then
        # tends to land in adjacent slots, which copy_blocks merges into one copy.
        self._free: deque[int] = deque(range(self.capacity))
        self._sums = np.zeros(self.capacity, dtype=np.uint64)

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: object) -> bool:
        return key in self._slot_of

    def keys(self) -> Iterator[BlockKey]:
        return iter(list(self._slot_of))

    def position(self, key: BlockKey) -> int:
        """The slot number holding ``key`` (raises ``KeyError`` when absent)."""
        return self._slot_of[key]

    def view(self, key: BlockKey) -> BlockArray:
        """Zero-copy view of the block's slot; valid until the block leaves this tier."""
        return self.memory.slot(self._slot_of[key])

    def store(self, key: BlockKey, src: BlockArray, checksum: int = NO_SUM) -> None:
        copy_into(self.reserve(key), src)
        self._sums[self._slot_of[key]] = checksum

    def checksum(self, key: BlockKey) -> int:
        """The block's end-to-end checksum (``NO_SUM`` when none is known)."""
        return int(self._sums[self._slot_of[key]])

    def set_checksum(self, key: BlockKey, checksum: int) -> None:
        self._sums[self._slot_of[key]] = checksum

    def reserve(self, key: BlockKey) -> BlockArray:
        """Index ``key`` in a free slot and return the slot's view, for the caller to fill
        before the block is read (``put`` fills a whole batch at once, merging copies)."""
        slot = self.take_slot()
        self.adopt(key, slot)  # no checksum until the caller sets one
        return self.memory.slot(slot)

    def take_slot(self) -> int:
        """Take a free slot without indexing anything in it (a staged put fills it first;
        the store counts it as used)."""
        return self._free.popleft()

    def free_slot(self, slot: int) -> None:
        """Give back a slot taken with :meth:`take_slot` and never adopted."""
        self._free.append(slot)

    def adopt(self, key: BlockKey, slot: int) -> None:
        """Index ``key`` in ``slot`` (taken with :meth:`take_slot`, already filled)."""
        self._slot_of[key] = slot
        self._sums[slot] = NO_SUM
        self.policy.insert(key)

    def free_count(self) -> int:
        """Slots neither indexed nor taken."""
        return len(self._free)

    def adopt_many(self, keys: Sequence[BlockKey]) -> list[int]:
        """Take a free slot for each key and index it there (the caller fills the slots
        before anything reads them); ``free_count()`` must cover them."""
        free = self._free
        slots = [free.popleft() for _ in keys]
        self._sums[slots] = NO_SUM
        self._slot_of.update(zip(keys, slots, strict=True))
        insert_all(self.policy, keys)
        return slots

    def delete(self, key: BlockKey) -> None:
        self._free.append(self.disown(key))

    def discard(self, key: BlockKey) -> None:
        self.delete(key)

    def disown(self, key: BlockKey) -> int:
        """Forget ``key`` and return its slot without freeing it (the caller owns it now,
        as if taken with :meth:`take_slot`)."""
        self.policy.remove(key)
        return self._slot_of.pop(key)

    def touch(self, key: BlockKey) -> None:
        self.policy.touch(key)

    @contextlib.contextmanager
    def reading(self) -> Iterator[BlockReader]:
        yield self.view

    def batch(self) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    def close(self) -> None:
        self._slot_of.clear()
        self._free.clear()
        self.memory.close()
