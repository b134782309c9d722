"""``kvbridge replay``: the prefix-cache hit rate a trace gets, per capacity and policy.

The replay runs the store's own eviction policies (``kvbridge.store.POLICIES``, the same
objects a ``TieredStore`` tier calls) over an index of block keys, without payload bytes.
Semantics (those of the reference hit rates published with the Mooncake traces, which
``tests/test_replay.py`` reproduces): a request's hit is the number of its leading blocks
present, times 512 tokens, capped at its ``input_length``; the hit rate is the sum of hits
over the sum of ``input_length``; after its lookup every block of the request is stored (or,
if present, touched), evicting the policy's coldest block while the cache is full. Capacity
counts 512-token blocks (``tokens // 512``).

``belady`` is the offline optimum for reference: it evicts the block whose next use is
farthest in the future (it reads the whole trace first).

``--host-capacity`` with ``--disk-capacity`` replays the trace through a host tier over a
disk tier instead, as a ``TieredStore`` places blocks, with hits, promotions and demotions
by tier (:mod:`._replay_tiers`).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbridge.store import BlockKey
from kvbridge.store.local import POLICIES

from ._replay_tiers import (
    BYTES_PER_TOKEN,
    DISK_GBPS,
    LINK_GBPS,
    Costs,
    TierReplayResult,
    replay_tiers,
    table,
)
from ._workload import TRACE_BLOCK_TOKENS

OFFLINE = "belady"


@dataclass(frozen=True)
class TraceRequest:
    input_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    capacity_tokens: int
    hit_rate: float
    hit_tokens: int
    prompt_tokens: int
    requests: int


def load_requests(path: str) -> list[TraceRequest]:
    """Read a Mooncake trace (JSON lines); ``ValueError`` names a bad line."""
    requests = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                requests.append(
                    TraceRequest(
                        int(entry["input_length"]), tuple(int(h) for h in entry["hash_ids"])
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a trace request ({exc})") from None
    return requests


def replay(
    requests: Sequence[TraceRequest],
    capacity_tokens: float,
    policy: str,
    *,
    from_request: int = 0,
) -> ReplayResult:
    """Hit rate of ``requests`` through a cache of ``capacity_tokens`` under ``policy`` (a
    name in ``POLICIES``, or ``"belady"``; ``math.inf`` capacity for unlimited). Requests
    before ``from_request`` only warm the cache."""
    unlimited = capacity_tokens == float("inf")
    blocks = 1 << 62 if unlimited else int(capacity_tokens // TRACE_BLOCK_TOKENS)
    if blocks < 1:
        raise ValueError(f"a capacity of {capacity_tokens} tokens holds no 512-token block")
    if policy == OFFLINE:
        hits = _belady(requests, blocks)
    elif policy in POLICIES:
        hits = _online(requests, blocks, policy)
    else:
        raise ValueError(f"unknown policy {policy!r}; choose from {policy_names()}")
    counted = requests[from_request:]
    hit_tokens = sum(hits[from_request:])
    prompt_tokens = sum(r.input_length for r in counted)
    return ReplayResult(
        policy=policy,
        capacity_tokens=-1 if unlimited else int(capacity_tokens),
        hit_rate=hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        hit_tokens=hit_tokens,
        prompt_tokens=prompt_tokens,
        requests=len(counted),
    )


def policy_names() -> list[str]:
    return [*sorted(POLICIES), OFFLINE]


def _key(hash_id: int) -> BlockKey:
    return BlockKey(hash_id.to_bytes(8, "little", signed=True))


def hit_tokens(request: TraceRequest, present: Any) -> int:
    """Tokens of ``request`` served by its leading blocks in ``present``."""
    blocks = 0
    for hash_id in request.hash_ids:
        if hash_id not in present:
            break
        blocks += 1
    return min(blocks * TRACE_BLOCK_TOKENS, request.input_length)


def _online(requests: Sequence[TraceRequest], capacity: int, name: str) -> list[int]:
    policy = POLICIES[name]()
    present: set[int] = set()
    hits = []
    for request in requests:
        hits.append(hit_tokens(request, present))
        for hash_id in request.hash_ids:
            key = _key(hash_id)
            if hash_id in present:
                policy.touch(key)
                continue
            if len(present) >= capacity:
                victim = next(policy.candidates())
                policy.remove(victim)
                present.discard(int.from_bytes(victim, "little", signed=True))
            present.add(hash_id)
            policy.insert(key)
    return hits


def _belady(requests: Sequence[TraceRequest], capacity: int) -> list[int]:
    """Evict the block whose next use (the index of the next request holding it) is
    farthest away; ties go to the larger hash id (lazy-deletion max-heap)."""
    sequence = [(t, h) for t, r in enumerate(requests) for h in r.hash_ids]
    never = len(requests) + 1
    next_use = [never] * len(sequence)
    seen: dict[int, int] = {}
    for i in range(len(sequence) - 1, -1, -1):
        t, hash_id = sequence[i]
        next_use[i] = seen.get(hash_id, never)
        seen[hash_id] = t
    present: dict[int, int] = {}  # hash id -> its next use
    heap: list[tuple[int, int]] = []
    hits, position = [], 0
    for request in requests:
        hits.append(hit_tokens(request, present))
        for hash_id in request.hash_ids:
            if hash_id not in present:
                while len(present) >= capacity:
                    negative, victim = heapq.heappop(heap)
                    if present.get(victim) == -negative:
                        del present[victim]
            present[hash_id] = next_use[position]
            heapq.heappush(heap, (-next_use[position], hash_id))
            position += 1
        if len(heap) > 4 * max(len(present), 1024):
            heap = [(-n, h) for h, n in present.items()]
            heapq.heapify(heap)
    return hits


def parse_tokens(text: str) -> float:
    """``"3M"`` -> 3e6 tokens (k, M, G are powers of 1000); ``"inf"`` for unlimited."""
    value = text.strip().lower()
    if value in ("inf", "unlimited"):
        return float("inf")
    scale = {"k": 1e3, "m": 1e6, "g": 1e9}.get(value[-1:], 1.0)
    number = value[:-1] if value[-1:] in ("k", "m", "g") else value
    try:
        tokens = float(number) * scale
    except ValueError:
        raise ValueError(f"not a token count: {text!r} (try 3M or 500k)") from None
    if tokens <= 0:
        raise ValueError(f"capacity must be positive: {text!r}")
    return tokens


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "replay",
        help="prefix-cache hit rate of a trace per capacity and eviction policy",
        description="Replay a Mooncake trace through the store's eviction policies and "
        "print the token-level prefix hit rate per capacity and policy, in one cache "
        "(--capacity) or by tier, a host tier over a disk tier (--host-capacity, "
        "--disk-capacity).",
    )
    parser.add_argument("trace", nargs="?", help="trace file (JSON lines)")
    parser.add_argument(
        "--capacity", action="append", help="cache size in tokens (3M, 500k; repeatable)"
    )
    parser.add_argument("--policy", action="append", help="policy name (repeatable)")
    parser.add_argument("--list-policies", action="store_true", help="print the policies")
    parser.add_argument("--from-request", type=int, default=0, help="count from request N")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--sweep", help="draw hit rate against capacity into this PNG")
    tiers = parser.add_argument_group("by tier (a host tier over a disk tier, as TieredStore)")
    tiers.add_argument(
        "--host-capacity", action="append", help="host tier size in tokens (repeatable)"
    )
    tiers.add_argument(
        "--disk-capacity",
        action="append",
        help="disk tier size in tokens, one per --host-capacity (none: host only)",
    )
    tiers.add_argument(
        "--bytes-per-token",
        type=int,
        help=f"KV bytes per token (default {BYTES_PER_TOKEN:,}: Llama-3-8B, bf16)",
    )
    tiers.add_argument(
        "--link-gbps", type=float, help=f"host-to-engine link, Gbit/s (default {LINK_GBPS:g})"
    )
    tiers.add_argument("--disk-gbps", type=float, help=f"disk read, Gbit/s (default {DISK_GBPS:g})")
    tiers.add_argument(
        "--write-back",
        action="store_true",
        help="new blocks reach the disk when the host demotes them, as a TieredStore's "
        "default (default: written through as they are stored, as kvbridge serve does)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.list_policies:
        for name in policy_names():
            doc = "offline optimum (knows the future)" if name == OFFLINE else _summary(name)
            print(f"{name:8s} {doc}")
        return 0
    try:
        pairs = _tier_pairs(args)
        requests = _checked(args)
        capacities = [_capacity(c) for c in (args.capacity or ["3M"])]
        costs = _costs(args, tiered=bool(pairs))
    except (ValueError, OSError, ImportError) as exc:
        print(f"kvbridge replay: {exc}", file=sys.stderr)
        return 2
    policies = args.policy or ["lru", "reuse"]
    if pairs:
        through = not args.write_back
        tiered = [
            _beside_one_cache(
                replay_tiers(
                    requests,
                    host,
                    disk,
                    name,
                    from_request=args.from_request,
                    costs=costs,
                    write_through=through,
                ),
                requests,
                args.from_request,
            )
            for host, disk in pairs
            for name in policies
        ]
        print(json.dumps([r.__dict__ for r in tiered], indent=1) if args.json else table(tiered))
        return 0
    results = [
        replay(requests, capacity, name, from_request=args.from_request)
        for capacity in capacities
        for name in policies
    ]
    print(json.dumps([r.__dict__ for r in results], indent=1) if args.json else _table(results))
    if args.sweep:
        sweep(requests, policies, args.sweep, from_request=args.from_request)
        print(f"sweep: {args.sweep}", file=sys.stderr)
    return 0


def _checked(args: argparse.Namespace) -> list[TraceRequest]:
    """The trace's requests, once the policies, ``--from-request`` and ``--sweep`` are
    checked: ``ValueError`` for a bad one (``OSError`` for an unreadable trace,
    ``ImportError`` for a sweep without matplotlib)."""
    if not args.trace:
        raise ValueError("give a trace file (Mooncake JSONL; tests/data/traces has two)")
    requests = load_requests(args.trace)
    for name in args.policy or []:
        if name not in policy_names():
            raise ValueError(f"unknown policy {name!r}; choose from {policy_names()}")
    if not 0 <= args.from_request < len(requests):
        raise ValueError(f"--from-request must be in 0..{len(requests) - 1}")
    if args.sweep:
        import matplotlib  # noqa: F401, PLC0415 - fail before the work if missing
    return requests


def _beside_one_cache(
    result: TierReplayResult, requests: Sequence[TraceRequest], from_request: int
) -> TierReplayResult:
    """``result`` beside its policy over one cache of its two tiers' sum, and of its disk
    alone (where it has one)."""
    host, disk, policy = result.host_capacity_tokens, result.disk_capacity_tokens, result.policy
    both = replay(requests, host + disk, policy, from_request=from_request).hit_rate
    alone = replay(requests, disk, policy, from_request=from_request).hit_rate if disk else None
    return dataclasses.replace(result, one_cache_hit_rate=both, disk_alone_hit_rate=alone)


def _tier_pairs(args: argparse.Namespace) -> list[tuple[float, float]]:
    """(host, disk) capacities in tokens, disk 0 for none; empty for a one-tier replay."""
    hosts, disks = args.host_capacity or [], args.disk_capacity or []
    if not hosts:
        if disks:
            raise ValueError("--disk-capacity needs a --host-capacity above it")
        if args.write_back:
            raise ValueError("--write-back is for a replay by tier (--host-capacity)")
        return []
    if args.capacity:
        raise ValueError("--capacity is one cache, --host-capacity a tier: give one of them")
    if disks and len(disks) != len(hosts):
        raise ValueError(
            f"give one --disk-capacity per --host-capacity ({len(hosts)} hosts, {len(disks)} disks)"
        )
    if args.sweep:
        raise ValueError("--sweep draws one cache: leave --host-capacity out")
    if OFFLINE in (args.policy or []):
        raise ValueError(f"{OFFLINE} is one cache's optimum; the tiers run {sorted(POLICIES)}")
    host_tokens = [_capacity(host) for host in hosts]
    disk_tokens = [_capacity(disk) for disk in disks] or [0.0] * len(hosts)
    return list(zip(host_tokens, disk_tokens, strict=True))


def _capacity(text: str) -> float:
    """:func:`parse_tokens` of a cache or tier size, which must hold a block."""
    tokens = parse_tokens(text)
    if tokens < TRACE_BLOCK_TOKENS:
        raise ValueError(f"a capacity of {text} tokens holds no 512-token block")
    return tokens


def _costs(args: argparse.Namespace, *, tiered: bool) -> Costs:
    """The tier replay's block size and rates, defaults where not given."""
    given = {
        "bytes_per_token": args.bytes_per_token,
        "link_gbps": args.link_gbps,
        "disk_gbps": args.disk_gbps,
    }
    for name, value in given.items():
        flag = "--" + name.replace("_", "-")
        if value is not None and not tiered:
            raise ValueError(f"{flag} is for a replay by tier (--host-capacity)")
        if value is not None and not 0 < value < float("inf"):
            raise ValueError(f"{flag} must be a positive number, not {value}")
    return Costs(**{name: value for name, value in given.items() if value is not None})


def _table(results: Sequence[ReplayResult]) -> str:
    lru = {r.capacity_tokens: r.hit_rate for r in results if r.policy == "lru"}
    lines = [f"{'capacity':>12}  {'policy':8s}  {'hit rate':>8}  {'vs lru':>6}"]
    for r in results:
        base = lru.get(r.capacity_tokens)
        versus = f"{r.hit_rate / base:6.2f}" if base else "     -"
        size = "unlimited" if r.capacity_tokens < 0 else f"{r.capacity_tokens:,}"
        lines.append(f"{size:>12}  {r.policy:8s}  {r.hit_rate:8.4f}  {versus}")
    return "\n".join(lines)


def _summary(name: str) -> str:
    doc = (POLICIES[name].__doc__ or "").strip().splitlines()
    return doc[0] if doc else ""


def sweep(
    requests: Sequence[TraceRequest], policies: Sequence[str], path: str, *, from_request: int
) -> None:
    """Hit rate against capacity (0.25M to 32M tokens) for each policy, with the unlimited
    cache and the offline optimum."""
    import matplotlib  # noqa: PLC0415 - optional

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    capacities = [0.25e6 * 2**i for i in range(8)]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name in [*dict.fromkeys([*policies, OFFLINE])]:
        rates = [replay(requests, c, name, from_request=from_request).hit_rate for c in capacities]
        axes.plot(capacities, rates, marker="o", label=name)
    unlimited = replay(requests, float("inf"), "lru", from_request=from_request).hit_rate
    axes.axhline(unlimited, linestyle="--", color="grey", label="unlimited")
    axes.set_xscale("log")
    axes.set_xlabel("cache capacity (tokens)")
    axes.set_ylabel("prefix hit rate (tokens)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
