"""A tier's eviction order as the store walks it: the tier's policy, less its pinned blocks.

A pinned block may not be evicted, demoted or promoted, so making room must never pick it.
Rather than stepping over pinned blocks on every walk (O(pinned) per put, and a policy that
ranks them coldest made a batch O(pinned x batch)), the store takes them out of the walk
while they are pinned, as vLLM's block pool takes in-use blocks out of its free queue: the
:class:`~kvbridge.store.PinTable` says when a key gains its first pin or loses its last, and
:class:`HeldOrder` holds or releases it in the policy of each tier that has it. A block
that arrives in a tier while pinned (a copy up, a write-through) is held on arrival.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Sequence

from .._keys import BlockKey
from ._changes import Changes
from ._policy import EvictionPolicy, insert_all


class HeldOrder:
    """An :class:`EvictionPolicy` around a tier's own: keys in ``pinned`` are held."""

    def __init__(
        self, policy: EvictionPolicy, pinned: Container[BlockKey], changes: Changes | None = None
    ) -> None:
        self.policy = policy
        self._pinned = pinned
        self._changes = changes or Changes()
        """Where the keys the tier gains or loses are noted (for the store's watcher)."""
        self.held: set[BlockKey] = set()
        """The tier's keys that are pinned now (so ``len(held)`` slots cannot be freed)."""

    def insert(self, key: BlockKey) -> None:
        self.policy.insert(key)
        self._changes.note(key)
        if key in self._pinned:
            self.hold(key)

    def insert_many(self, keys: Sequence[BlockKey]) -> None:
        """:meth:`insert` of each key, in one call where the policy has ``insert_many``."""
        insert_all(self.policy, keys)
        self._changes.note_all(keys)
        pinned = self._pinned
        if len(pinned):  # type: ignore[arg-type]  # a PinTable, or any sized container
            for key in [key for key in keys if key in pinned]:
                self.hold(key)

    def touch(self, key: BlockKey) -> None:
        self.policy.touch(key)

    def remove(self, key: BlockKey) -> None:
        self.held.discard(key)
        self.policy.remove(key)
        self._changes.note(key)

    def hold(self, key: BlockKey) -> None:
        if key not in self.held:
            self.held.add(key)
            self.policy.hold(key)

    def release(self, key: BlockKey) -> None:
        if key in self.held:
            self.held.discard(key)
            self.policy.release(key)

    def candidates(self) -> Iterator[BlockKey]:
        return self.policy.candidates()

    def ranking(self) -> Iterator[BlockKey]:
        return self.policy.ranking()
