"""Eviction policies: small objects that only order keys.

A tier owns its index, its pins and its capacity; a policy is told what happened
(``insert``, ``touch``, ``remove``) and answers one question: which keys to evict first
(``candidates``, coldest first). The tier walks the candidates and skips the ones it cannot
evict (pinned, or part of the batch being stored), so a policy never needs to know about pins.

Every operation is O(1) (amortised). Add a policy by writing a class with these four methods
and registering it in :data:`POLICIES`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Protocol

from ._keys import BlockKey


class EvictionPolicy(Protocol):
    """Orders a tier's keys for eviction."""

    def insert(self, key: BlockKey) -> None:
        """``key`` was stored in the tier."""

    def touch(self, key: BlockKey) -> None:
        """``key`` was read (a hit) or stored again (a duplicate put)."""

    def remove(self, key: BlockKey) -> None:
        """``key`` left the tier (evicted, demoted, promoted away or removed)."""

    def candidates(self) -> Iterator[BlockKey]:
        """Keys in eviction order, coldest first. Must not be held across a mutation."""


class LRU:
    """Least recently used: a hit or a duplicate put moves the key to the hot end."""

    def __init__(self) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    def insert(self, key: BlockKey) -> None:
        self._order[key] = None

    def touch(self, key: BlockKey) -> None:
        self._order.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        del self._order[key]

    def candidates(self) -> Iterator[BlockKey]:
        return iter(self._order)


class FIFO:
    """First in, first out: the oldest stored block goes first; hits change nothing."""

    def __init__(self) -> None:
        self._order: dict[BlockKey, None] = {}

    def insert(self, key: BlockKey) -> None:
        self._order[key] = None

    def touch(self, key: BlockKey) -> None:
        pass

    def remove(self, key: BlockKey) -> None:
        del self._order[key]

    def candidates(self) -> Iterator[BlockKey]:
        return iter(self._order)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRU, "fifo": FIFO}
"""Policies selectable by name (``TieredStore(policy="lru")``)."""


def make_policy(policy: str | Callable[[], EvictionPolicy]) -> EvictionPolicy:
    """Return a fresh policy from a registered name or a zero-argument factory."""
    if callable(policy):
        return policy()
    factory = POLICIES.get(policy)
    if factory is None:
        raise ValueError(f"unknown eviction policy {policy!r}; choose one of {sorted(POLICIES)}")
    return factory()
