"""Eviction policies: small objects that only order keys.

A tier owns its index and its capacity; a policy is told what happened (``insert``,
``touch``, ``remove``) and answers one question: which keys to evict first (``candidates``,
coldest first). The store takes a pinned block out of the walk while it is pinned
(``hold``, ``release``: it keeps its place in the order), so making room never steps over
one, and walks the candidates itself (``Placement._make_room_for``).

``TieredStore`` defaults to ``lru``; the cache server to ``reuse`` (:class:`ReuseLRU`), which
beats LRU on shared-prefix workloads (figures in ``benches/README.md``).
Every operation is O(1) (amortised; see :mod:`._order` for a release). Add a policy by
writing a class with the methods of :class:`EvictionPolicy` and registering it in
:data:`POLICIES`.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from .._keys import BlockKey
from ._order import Stamped, StampOrder


class EvictionPolicy(Protocol):
    """Orders a tier's keys for eviction."""

    def insert(self, key: BlockKey) -> None:
        """``key`` was stored in the tier."""

    def touch(self, key: BlockKey) -> None:
        """``key`` was read (a hit) or stored again (a duplicate put)."""

    def remove(self, key: BlockKey) -> None:
        """``key`` left the tier (evicted, demoted, promoted away or removed)."""

    def hold(self, key: BlockKey) -> None:
        """``key`` (present) may not be evicted: leave it out of ``candidates`` until
        ``release``. It keeps its place: uses still count, and ``ranking`` shows it."""

    def release(self, key: BlockKey) -> None:
        """``key`` may be evicted again (a key not held is ignored)."""

    def candidates(self) -> Iterator[BlockKey]:
        """Keys not held, in eviction order, coldest first. Must not be held across a
        mutation."""

    def ranking(self) -> Iterator[BlockKey]:
        """Every key, held ones included, in eviction order (for views, not for eviction)."""


class LRU:
    """Least recently used: a hit or a duplicate put moves the key to the hot end."""

    def __init__(self) -> None:
        self._queue = StampOrder()
        self._stamps = itertools.count()

    def insert(self, key: BlockKey) -> None:
        self._queue.add(key, next(self._stamps))

    def insert_many(self, keys: Sequence[BlockKey]) -> None:
        """:meth:`insert` of each key in order (a batch of new blocks)."""
        self._queue.add_many(zip(keys, self._stamps, strict=False))  # stamps never end

    def touch(self, key: BlockKey) -> None:
        self._queue.restamp(key, next(self._stamps))

    def remove(self, key: BlockKey) -> None:
        self._queue.remove(key)

    def hold(self, key: BlockKey) -> None:
        self._queue.hold(key)

    def release(self, key: BlockKey) -> None:
        self._queue.release(key)

    def candidates(self) -> Iterator[BlockKey]:
        return self._queue.keys()

    def ranking(self) -> Iterator[BlockKey]:
        return (key for key, _ in self._queue.everything())


class FIFO(LRU):
    """First in, first out: the oldest stored block goes first; hits change nothing."""

    def touch(self, key: BlockKey) -> None:
        pass


class ReuseLRU:
    """LRU that evicts blocks never reused before blocks that were: better than LRU for
    shared prefix caches (the cache server's default).

    Why it works. In a prefix cache most blocks are used once: the tail of a conversation
    that never continues, a document asked about once. In the Kimi and synthetic Mooncake
    traces 77% and 58% of blocks are never used again, but a block that has been used twice
    is used again with probability 0.43-0.84 (against 0.23-0.42 for a new one), and reuse
    comes late: half of all reuses come more than a cache's worth of newer blocks after the
    last use, which is exactly where LRU has already dropped them. So this policy keeps two
    recency queues: blocks seen for the first time, and blocks seen before (the block is in
    the queue of reused blocks when it is touched, or when it comes back within the ghost
    history of recently evicted keys). The victim is the coldest new block, unless the
    coldest reused block has gone unused for ``protect`` times the cache's size in accesses
    (so a block reused long ago cannot hold its slot forever). New blocks still get the
    whole cache while nothing was reused, so a workload without reuse runs as LRU.

    Nothing in it knows a trace: its only constants are ratios to the cache's own size.
    What it gains over LRU on the Mooncake traces, where it loses, and how far an online
    policy could go there: ``benches/README.md`` ("Prefix-cache hit rate by eviction policy").

    All operations are O(1): two stamp-ordered queues and a bounded ghost dict;
    ``candidates`` merges the two queues' heads lazily.
    """

    PROTECT = 8
    """A reused block outranks new ones until it goes ``PROTECT`` x cache-size accesses
    without use. Conversation trace at 3M / 8M tokens: 2x gave 0.162 / 0.273, 4x 0.177 /
    0.258, 8x 0.178 / 0.249 (LRU 0.141 / 0.259): longer protection wins small caches and
    costs a little in large ones."""
    GHOSTS = 8
    """Evicted keys remembered, as a multiple of the cache size (reuse comes late; 4x and
    8x gave the same 3M figures, 8x 0.157 against 0.155 on the synthetic trace at 1M)."""

    def __init__(self) -> None:
        self._new = StampOrder()
        self._reused = StampOrder()
        self._ghosts: OrderedDict[BlockKey, None] = OrderedDict()
        self._clock = 0
        self._size = 0
        """Keys in both queues (kept here: a StampOrder's len is three)."""

    def insert(self, key: BlockKey) -> None:
        self._clock += 1
        self._size += 1
        if key in self._ghosts:  # it was here before: a reuse
            del self._ghosts[key]
            self._reused.add(key, self._clock)
        else:
            self._new.add(key, self._clock)

    def touch(self, key: BlockKey) -> None:
        self._clock += 1
        if self._reused.restamp(key, self._clock):
            return
        held = self._new.is_held(key)  # a first reuse: the key changes queues, held or not
        self._new.remove(key)
        self._reused.add(key, self._clock)
        if held:
            self._reused.hold(key)

    def remove(self, key: BlockKey) -> None:
        if not self._new.discard(key):
            self._reused.remove(key)
        self._size -= 1
        self._ghosts[key] = None
        limit = self.GHOSTS * max(self._size, 1)
        while len(self._ghosts) > limit:
            self._ghosts.popitem(last=False)

    def hold(self, key: BlockKey) -> None:
        self._queue_of(key).hold(key)

    def release(self, key: BlockKey) -> None:
        self._queue_of(key).release(key)

    def candidates(self) -> Iterator[BlockKey]:
        return self._interleave(self._new.walk(), self._reused.walk())

    def ranking(self) -> Iterator[BlockKey]:
        return self._interleave(self._new.everything(), self._reused.everything())

    def _queue_of(self, key: BlockKey) -> StampOrder:
        return self._new if key in self._new else self._reused

    def _interleave(self, new: Iterator[Stamped], reused: Iterator[Stamped]) -> Iterator[BlockKey]:
        """The two queues merged: the coldest new block first, unless the coldest reused
        one has gone ``PROTECT`` x the cache's size in accesses without use."""
        grace = self.PROTECT * self._size
        n, r = next(new, None), next(reused, None)
        while n is not None or r is not None:
            if r is None or (n is not None and n[1] <= r[1] + grace):
                assert n is not None
                yield n[0]
                n = next(new, None)
            else:
                yield r[0]
                r = next(reused, None)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRU, "fifo": FIFO, "reuse": ReuseLRU}
"""Policies selectable by name (``TieredStore(policy="lru")``)."""


_METHODS = ("insert", "touch", "remove", "hold", "release", "candidates", "ranking")


def insert_all(policy: EvictionPolicy, keys: Sequence[BlockKey]) -> None:
    """``policy.insert`` of each key in order, in one call where the policy has
    ``insert_many`` (an optional bulk form; custom policies need not have it)."""
    bulk = getattr(policy, "insert_many", None)
    if bulk is not None:
        bulk(keys)
        return
    for key in keys:
        policy.insert(key)


def check_policy(policy: EvictionPolicy) -> EvictionPolicy:
    """``policy`` if it has every method of :class:`EvictionPolicy`, else ``TypeError``."""
    lacking = [m for m in _METHODS if not callable(getattr(policy, m, None))]
    if lacking:
        raise TypeError(f"eviction policy {policy!r} lacks {', '.join(lacking)}")
    return policy


def make_policy(policy: str | Callable[[], EvictionPolicy]) -> EvictionPolicy:
    """Return a fresh policy from a registered name or a zero-argument factory."""
    if callable(policy):
        return check_policy(policy())
    factory = POLICIES.get(policy)
    if factory is None:
        raise ValueError(f"unknown eviction policy {policy!r}; choose one of {sorted(POLICIES)}")
    return factory()
