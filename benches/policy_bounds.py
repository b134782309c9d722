"""How far an online eviction policy can get on a trace: the bounds behind ``reuse``.

    python benches/policy_bounds.py TRACE [--capacity 3M] [--only NAME ...]

``kvbridge replay`` measures the store's policies and the offline optimum. This study adds
policies that are told part of the future, to show where the room between LRU and Belady
lies and how much of it an online policy could ever reach with the signals a store sees.
Same semantics as ``kvbridge replay`` (token prefix hit rate; every block of a request is
stored or touched after its lookup; capacity in 512-token blocks). Each line is printed as
it finishes (the class-density runs take about a minute each).

- ``lru``, ``reuse``, ``belady``: as ``kvbridge replay`` (the store's own policy objects).
- ``oracle-keep``: LRU that knows, at every access, whether the block will be used again;
  blocks that will not go to a cold queue that is evicted first.
- ``oracle-dead``: the same knowledge only for blocks seen before (the death of a reused
  block: its conversation has ended); blocks seen for the first time always go to the cold
  queue. This is ``reuse`` with a perfect detector of dead reused blocks.
- ``density-*``: each access gets a class from signals a store does see online: the block's
  use count (``f``), the request's length in blocks (``len``) and the block's last reuse
  interval (``gap``), each in powers of two. The policy is given the exact distribution of
  the next-use interval of every class over the whole trace (more than an online learner can
  know) and evicts the block with the lowest hit density at its age (expected hits over
  expected cache time, as in LHD), only ever a block without a cached child so that prefix
  chains stay whole. It shows what ranking by those signals reaches when the statistics
  are perfect; an online policy has to learn them as it goes (not a proof that no online
  policy could do better, but the strongest use of these signals found).
"""

from __future__ import annotations

import argparse
import bisect
import functools
import math
import sys
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable, Container, Sequence
from typing import Protocol

from kvbridge.tools._replay import TraceRequest, hit_tokens, load_requests, parse_tokens, replay
from kvbridge.tools._workload import TRACE_BLOCK_TOKENS

AGES = [0, *(int(2 ** (k / 2)) for k in range(2, 40))]
"""Age grid (in block accesses) on which hit density is evaluated."""


class _Cache(Protocol):
    @property
    def present(self) -> Container[int]: ...

    def request(self, hash_ids: Sequence[int]) -> None: ...


def _run(requests: Sequence[TraceRequest], cache: _Cache) -> float:
    hits = 0
    for request in requests:
        hits += hit_tokens(request, cache.present)
        cache.request(request.hash_ids)
    return hits / sum(r.input_length for r in requests)


def _used_again(requests: Sequence[TraceRequest]) -> tuple[list[bool], list[bool]]:
    """Per access in trace order: will the block be used again; is this its first use."""
    sequence = [h for r in requests for h in r.hash_ids]
    remaining = Counter(sequence)
    seen: set[int] = set()
    again, first = [], []
    for hash_id in sequence:
        remaining[hash_id] -= 1
        again.append(remaining[hash_id] > 0)
        first.append(hash_id not in seen)
        seen.add(hash_id)
    return again, first


class _ColdFirstLRU:
    """Two LRU queues; the cold one is evicted first. ``hot(i)`` decides access ``i``."""

    def __init__(self, capacity: int, hot: Callable[[int], bool]) -> None:
        self.capacity, self.hot_for = capacity, hot
        self.present: set[int] = set()
        self.hot: OrderedDict[int, None] = OrderedDict()
        self.cold: OrderedDict[int, None] = OrderedDict()
        self.access = 0

    def request(self, hash_ids: Sequence[int]) -> None:
        for hash_id in hash_ids:
            self.hot.pop(hash_id, None)
            self.cold.pop(hash_id, None)
            if hash_id not in self.present:
                if len(self.present) >= self.capacity:
                    victim, _ = (self.cold or self.hot).popitem(last=False)
                    self.present.discard(victim)
                self.present.add(hash_id)
            (self.hot if self.hot_for(self.access) else self.cold)[hash_id] = None
            self.access += 1


def _classes(requests: Sequence[TraceRequest], features: Sequence[str]) -> list[tuple[int, ...]]:
    """The class of every access in trace order, from what a store sees at that access."""

    def log2(value: int, top: int) -> int:
        return min(int(math.log2(value)) if value > 0 else -1, top)

    uses: Counter[int] = Counter()
    last: dict[int, int] = {}
    out: list[tuple[int, ...]] = []
    for request in requests:
        for hash_id in request.hash_ids:
            uses[hash_id] += 1
            now = len(out)
            interval = now - last[hash_id] if hash_id in last else 0
            last[hash_id] = now
            signal = {
                "f": log2(uses[hash_id], 4),
                "len": log2(len(request.hash_ids), 8),
                "gap": log2(interval, 17) // 2,
            }
            out.append(tuple(signal[name] for name in features))
    return out


def _densities(
    requests: Sequence[TraceRequest], classes: Sequence[tuple[int, ...]], horizon: int
) -> dict[tuple[int, ...], list[float]]:
    """Hit density of each class at each age of ``AGES``, from the true next-use intervals:
    density(a) = (uses after age a) / (cache time they and the never-reused still cost),
    where a block not used again within ``horizon`` costs ``horizon - a``."""
    sequence = [h for r in requests for h in r.hash_ids]
    intervals: dict[tuple[int, ...], list[int]] = defaultdict(list)
    never: Counter[tuple[int, ...]] = Counter()
    next_seen: dict[int, int] = {}
    for i in range(len(sequence) - 1, -1, -1):
        later = next_seen.get(sequence[i])
        next_seen[sequence[i]] = i
        if later is None or later - i > horizon:
            never[classes[i]] += 1
        else:
            intervals[classes[i]].append(later - i)
    tables = {}
    for cls in set(classes):
        gaps = sorted(intervals[cls])
        suffix = [0] * (len(gaps) + 1)
        for j in range(len(gaps) - 1, -1, -1):
            suffix[j] = suffix[j + 1] + gaps[j]
        row = []
        for age in AGES:
            j = bisect.bisect_right(gaps, age)
            cost = suffix[j] - age * (len(gaps) - j) + never[cls] * max(horizon - age, 1)
            row.append((len(gaps) - j) / cost if cost > 0 else 0.0)
        tables[cls] = row
    return tables


class _Block:
    __slots__ = ("children", "cls", "parent", "stamp")

    def __init__(self, cls: tuple[int, ...], stamp: int, parent: int | None) -> None:
        self.cls, self.stamp, self.parent, self.children = cls, stamp, parent, 0


class _ClassDensity:
    """Evicts the cached leaf block with the lowest hit density at its age."""

    def __init__(
        self,
        capacity: int,
        classes: Sequence[tuple[int, ...]],
        tables: dict[tuple[int, ...], list[float]],
    ) -> None:
        self.capacity, self.classes, self.tables = capacity, classes, tables
        self.present: dict[int, _Block] = {}
        self.leaves: dict[tuple[int, ...], list[int]] = defaultdict(list)  # sorted stamps
        self.owner: dict[int, int] = {}  # stamp (access number) -> block
        self.order = {c: sorted(range(len(AGES)), key=t.__getitem__) for c, t in tables.items()}
        self.access = 0

    def request(self, hash_ids: Sequence[int]) -> None:
        parent = None
        for hash_id in hash_ids:
            cls = self.classes[self.access]
            self.access += 1
            block = self.present.get(hash_id)
            if block is None:
                if parent is not None:  # the parent stops being a leaf before anything goes
                    up = self.present[parent]
                    if up.children == 0:
                        self._unleaf(up)
                    up.children += 1
                if len(self.present) >= self.capacity:
                    self._evict()
                block = self.present[hash_id] = _Block(cls, self.access, parent)
            else:
                if block.children == 0:
                    self._unleaf(block)
                del self.owner[block.stamp]
                block.cls, block.stamp = cls, self.access
            if block.children == 0:
                bisect.insort(self.leaves[block.cls], block.stamp)
            self.owner[block.stamp] = hash_id
            parent = hash_id

    def _unleaf(self, block: _Block) -> None:
        stamps = self.leaves[block.cls]
        del stamps[bisect.bisect_left(stamps, block.stamp)]

    def _evict(self) -> None:
        victim = self.owner.pop(self._victim())
        block = self.present.pop(victim)
        self._unleaf(block)
        up = self.present.get(block.parent) if block.parent is not None else None
        if up is not None:
            up.children -= 1
            if up.children == 0:
                bisect.insort(self.leaves[up.cls], up.stamp)

    def _victim(self) -> int:
        """The stamp of the least dense leaf: per class, its ages from the least dense
        down until one holds a leaf."""
        best: tuple[float, int] | None = None
        for cls, stamps in self.leaves.items():
            if not stamps:
                continue
            table = self.tables[cls]
            for k in self.order[cls]:
                if best is not None and table[k] > best[0]:
                    break
                newest = self.access - AGES[k]
                oldest = self.access - (AGES[k + 1] if k + 1 < len(AGES) else 1 << 60)
                j = bisect.bisect_right(stamps, oldest)
                if j < len(stamps) and stamps[j] <= newest:
                    best = min(best or (math.inf, 0), (table[k], stamps[j]))
                    break
        assert best is not None
        return best[1]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--capacity", default="3M")
    parser.add_argument("--only", action="append", help="run only these (repeatable)")
    args = parser.parse_args(argv)
    requests = load_requests(args.trace)
    capacity_tokens = parse_tokens(args.capacity)
    blocks = int(capacity_tokens // TRACE_BLOCK_TOKENS)
    again, first = _used_again(requests)
    runs: dict[str, Callable[[], float]] = {
        name: functools.partial(lambda n: replay(requests, capacity_tokens, n).hit_rate, name)
        for name in ("lru", "reuse", "belady")
    }
    runs["oracle-keep"] = lambda: _run(requests, _ColdFirstLRU(blocks, again.__getitem__))
    runs["oracle-dead"] = lambda: _run(
        requests, _ColdFirstLRU(blocks, lambda i: again[i] and not first[i])
    )
    for features in (("f",), ("f", "len"), ("f", "gap"), ("f", "len", "gap")):

        def density(features: tuple[str, ...] = features) -> float:
            classes = _classes(requests, features)
            tables = _densities(requests, classes, horizon=8 * blocks)
            return _run(requests, _ClassDensity(blocks, classes, tables))

        runs["density-" + "+".join(features)] = density
    lru = None
    for name, run in runs.items():
        if args.only and name not in args.only and name != "lru":
            continue
        rate = run()
        lru = rate if name == "lru" else lru
        ratio = f"{rate / lru:5.2f}x lru" if lru else ""
        print(f"{name:22s} {rate:.4f}  {ratio}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
