"""Eviction policies: small objects that only order keys.

A tier owns its index and its capacity; a policy is told what happened (``insert``,
``touch``, ``remove``) and answers one question: which keys to evict first (``candidates``,
coldest first). The store takes a pinned block out of the walk while it is pinned
(``hold``, ``release``: it keeps its place in the order), so making room never steps over
one, and walks the candidates itself (``Placement._make_room_for``).

``TieredStore`` defaults to ``lru``; the cache server to ``reuse`` (:class:`ReuseLRU`), which
beats LRU on shared-prefix workloads (figures in ``benches/README.md``). ``arc``
(:class:`ARC`) is the Adaptive Replacement Cache, which vLLM's CPU offloading also offers.
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


class ARC:
    """Adaptive Replacement Cache: a recency and a frequency list, split by ghost hits.

    ARC (Megiddo and Modha, FAST'03; vLLM's CPU offloading offers it too) keeps a list of
    blocks seen once and a list of blocks used again, and moves the split between them by
    what it would have kept, so that a scan of blocks used once cannot flush the blocks
    used again.

    Keys seen once are in T1, keys used again in T2, each in recency order (a first use
    moves a key from T1 to T2, held or not). Keys that leave the tier are remembered in the
    ghost list of the list they left (B1, B2). ``p`` is T1's target size: a key coming back
    from B1 (T1 was too small to keep it) raises it by ``max(1, |B2| / |B1|)``, one from B2
    lowers it by ``max(1, |B1| / |B2|)``, and it comes back into T2. The victim is T1's
    coldest key while T1 holds more than ``p`` keys, else T2's (or the other list's when one
    has no candidate left); ``candidates`` walks the victims of successive evictions, each
    one from T1 shrinking T1 by one. (The paper also evicts from T1 when it holds exactly
    ``p`` keys and the key to come is in B2: the policy does not know which key comes next.)
    A held key still counts in its list's size, as its block still takes a slot: while T1
    is above ``p`` with its coldest key held, T1's next key goes.

    The tier's capacity ``c`` is not given: the policy takes the most keys it has held at
    once, which is the capacity once the tier has been full and never more. ``p`` stays in
    ``[0, c]``, and the ghosts keep the paper's bounds: ``|T1| + |B1| <= c`` and all four
    lists at most ``2c``, so the ghosts never hold more than ``2c`` keys.

    All operations are O(1) (amortised, as :class:`LRU`'s): two stamp-ordered queues and two
    bounded ghost dicts. What it gains over LRU on the Mooncake traces: ``benches/README.md``.
    """

    def __init__(self) -> None:
        self._t1 = StampOrder()
        self._t2 = StampOrder()
        self._b1: OrderedDict[BlockKey, None] = OrderedDict()
        self._b2: OrderedDict[BlockKey, None] = OrderedDict()
        self._clock = 0
        self._size = 0
        """Keys in T1 and T2."""
        self._c = 0
        """The most keys held at once: the tier's capacity once it has been full."""
        self._p = 0.0
        """T1's target size, in ``[0, c]``."""

    def insert(self, key: BlockKey) -> None:
        self._clock += 1
        self._size += 1
        self._c = max(self._c, self._size)
        if key in self._b1:  # T1 was too small to keep it: give T1 more room
            self._p = min(self._p + max(1.0, len(self._b2) / len(self._b1)), self._c)
            del self._b1[key]
            self._t2.add(key, self._clock)
        elif key in self._b2:  # T2 was too small to keep it: give T2 more room
            self._p = max(self._p - max(1.0, len(self._b1) / len(self._b2)), 0.0)
            del self._b2[key]
            self._t2.add(key, self._clock)
        else:
            self._t1.add(key, self._clock)
        self._trim_ghosts()

    def touch(self, key: BlockKey) -> None:
        self._clock += 1
        if self._t2.restamp(key, self._clock):
            return
        held = self._t1.is_held(key)  # a first reuse: the key changes lists, held or not
        self._t1.remove(key)
        self._t2.add(key, self._clock)
        if held:
            self._t2.hold(key)

    def remove(self, key: BlockKey) -> None:
        self._size -= 1
        if self._t1.discard(key):
            self._b1[key] = None
        else:
            self._t2.remove(key)
            self._b2[key] = None
        self._trim_ghosts()

    def hold(self, key: BlockKey) -> None:
        self._list_of(key).hold(key)

    def release(self, key: BlockKey) -> None:
        self._list_of(key).release(key)

    def candidates(self) -> Iterator[BlockKey]:
        return self._replace(self._t1.keys(), self._t2.keys())

    def ranking(self) -> Iterator[BlockKey]:
        """:meth:`candidates` with each held key just before the next key of its own list
        (or after them all when none follows it): less the held keys, the same walk."""
        every = {
            True: (key for key, _ in self._t1.everything()),
            False: (key for key, _ in self._t2.everything()),
        }
        for key in self.candidates():
            for other in every[key in self._t1]:
                yield other
                if other == key:
                    break
        yield from every[True]
        yield from every[False]

    def _list_of(self, key: BlockKey) -> StampOrder:
        return self._t1 if key in self._t1 else self._t2

    def _replace(self, t1: Iterator[BlockKey], t2: Iterator[BlockKey]) -> Iterator[BlockKey]:
        """ARC's victims one after another: T1's coldest while T1 is above ``p``, else
        T2's; the other list's when one has none left."""
        over = len(self._t1) - self._p
        a, b = next(t1, None), next(t2, None)
        while a is not None or b is not None:
            if a is not None and (over > 0 or b is None):
                yield a
                over -= 1
                a = next(t1, None)
            else:
                assert b is not None
                yield b
                b = next(t2, None)

    def _trim_ghosts(self) -> None:
        """Forget the oldest ghosts beyond ``|T1| + |B1| <= c`` and ``|B1| + |B2| <= 2c -
        (|T1| + |T2|)``."""
        while self._b1 and len(self._t1) + len(self._b1) > self._c:
            self._b1.popitem(last=False)
        while len(self._b1) + len(self._b2) > 2 * self._c - self._size:
            (self._b2 or self._b1).popitem(last=False)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRU,
    "fifo": FIFO,
    "reuse": ReuseLRU,
    "arc": ARC,
}
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
