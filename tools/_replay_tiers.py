"""``kvbridge replay --host-capacity H --disk-capacity D``: a trace through a host tier over
a disk tier, as a :class:`~kvbridge.store.TieredStore` places blocks.

Each tier runs its own instance of the policy (as each store tier does) over an index of
block keys, without payload bytes. Per request, in order:

- lookup, as in the one-tier replay (:mod:`._replay`): the hit is the request's leading
  blocks present in either tier, 512 tokens each, capped at its ``input_length``. Each hit
  block's tokens count for the tier that serves it: the host when it holds the block, else
  the disk (host hits + disk hits = all hits);
- then each block of the request, as the store's ``get`` of the hit blocks and ``put`` of
  them all do: a block the host holds is touched there; one only on disk is touched there
  and, if it is among the hits, promoted: copied into the host (the disk is persistent and
  keeps its copy), where the put then touches it; one only on disk after the first miss is
  only touched (a put of a stored block is a use, not a promotion); a new block is stored
  in the host;
- a new block is also written through to the disk at once, as ``kvbridge serve`` writes
  every commit (``write_through=False``: a ``TieredStore``'s default, where a block reaches
  the disk only when the host demotes it);
- making room in the host demotes its policy's coldest block to the disk: written there,
  unless the disk still holds its copy (then nothing is written); making room on the disk
  drops its coldest block, which leaves the store unless the host holds it too. As the
  store's ``get`` and ``put`` protect their own keys, a tier's walk passes over the
  request's blocks (when a tier is smaller than one request and holds nothing else, its
  coldest block goes all the same). Without a disk tier a host victim leaves the store.

With ``persistent=False`` the lower tier is memory, as a store's host tier is under its
device tier: a promotion moves the block out of it (the tiers are exclusive). With ``lru``
that pair is exactly one LRU cache of both capacities (``tests/test_replay_tiers.py``); the
disk's kept copies are why a host over a disk hits less than one cache of their sum. Written
through, the disk holds every block the host does: the pair hits about as one cache of the
disk alone, the host serving the hottest of those hits faster.

Capacities count 512-token blocks. A block is ``512 * bytes_per_token`` bytes; a hit moves
its tokens' KV, from the host over the link or read from the disk, and the seconds this
takes are bytes over the rate, all hits of the counted requests together (a disk hit then
crosses the link too; that is not added).
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbridge.store import BlockKey
from kvbridge.store.local import POLICIES

from ._models import PRESETS
from ._workload import TRACE_BLOCK_TOKENS

if TYPE_CHECKING:  # the one-tier replay's module runs this one's command line
    from ._replay import TraceRequest

BYTES_PER_TOKEN = PRESETS["llama-3-8b"].kv_bytes_per_token
"""131,072: Llama-3-8B's KV per token in bf16 (2 x 32 layers x 8 KV heads x 128 x 2
bytes), a 7-8B-class model with grouped-query attention; a block is 64 MiB."""
LINK_GBPS = 100.0
"""Gbit/s from the cache server's host memory to the engine: one 100 GbE or EDR NIC."""
DISK_GBPS = 50.0
"""Gbit/s read from the disk tier: one PCIe 4.0 NVMe drive (about 6-7 GB/s sequential)."""


@dataclass(frozen=True)
class Costs:
    """What moving a block costs: its bytes and the two rates (Gbit/s, 10^9 bit/s)."""

    bytes_per_token: int = BYTES_PER_TOKEN
    link_gbps: float = LINK_GBPS
    disk_gbps: float = DISK_GBPS

    @property
    def block_bytes(self) -> int:
        return TRACE_BLOCK_TOKENS * self.bytes_per_token


@dataclass(frozen=True)
class TierReplayResult:
    policy: str
    host_capacity_tokens: int
    disk_capacity_tokens: int
    """0: no disk tier."""
    hit_rate: float
    host_hit_rate: float
    disk_hit_rate: float
    hit_tokens: int
    host_hit_tokens: int
    disk_hit_tokens: int
    prompt_tokens: int
    requests: int
    host_hit_blocks: int
    disk_hit_blocks: int
    promoted_blocks: int
    """Disk hits copied into the host (all of them: nothing is pinned)."""
    demoted_blocks: int
    """Host victims written to the disk (one whose disk copy was still there is not)."""
    evicted_blocks: int
    """Blocks that left the store."""
    written_blocks: int
    """New blocks written through to the disk as they were stored (``write_through``)."""
    promoted_bytes: int
    demoted_bytes: int
    written_bytes: int
    host_hit_bytes: int
    disk_hit_bytes: int
    host_hit_seconds: float
    """``host_hit_bytes`` over the link."""
    disk_hit_seconds: float
    """``disk_hit_bytes`` read from the disk."""
    bytes_per_token: int
    link_gbps: float
    disk_gbps: float
    write_through: bool = True
    one_cache_hit_rate: float | None = None
    """The same policy over one cache of host + disk, where the caller replayed it."""
    disk_alone_hit_rate: float | None = None
    """The same policy over one cache of the disk's size, where the caller replayed it."""


@dataclass
class _Moves:
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    host_hit_blocks: int = 0
    disk_hit_blocks: int = 0
    promoted: int = 0
    demoted: int = 0
    written: int = 0
    evicted: int = 0


class _Tier:
    """One simulated tier: the keys it holds, its capacity in blocks, its policy."""

    def __init__(self, blocks: int, policy: str) -> None:
        self.blocks = blocks
        self.keys: set[BlockKey] = set()
        self.policy = POLICIES[policy]()

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def full(self) -> bool:
        return len(self.keys) >= self.blocks

    def add(self, key: BlockKey) -> None:
        self.keys.add(key)
        self.policy.insert(key)

    def take(self, key: BlockKey) -> None:
        self.keys.remove(key)
        self.policy.remove(key)

    def evict(self, keep: Container[BlockKey]) -> BlockKey:
        """Take out and return the coldest key not in ``keep`` (the coldest of all when
        every key is in ``keep``)."""
        walk = self.policy.candidates()
        coldest = next(walk)
        victim = next((k for k in walk if k not in keep), coldest) if coldest in keep else coldest
        self.take(victim)
        return victim


class _TwoTiers:
    """A host tier over an optional lower tier, and what moved between them."""

    def __init__(
        self, host_blocks: int, disk_blocks: int, policy: str, *, persistent: bool, through: bool
    ) -> None:
        self.host = _Tier(host_blocks, policy)
        self.disk = _Tier(disk_blocks, policy) if disk_blocks else None
        self.persistent = persistent
        # a memory tier below holds no copies: nothing is written through to it
        self.through = through and persistent and self.disk is not None
        self.moves = _Moves()

    def serve(self, request: TraceRequest) -> None:
        """Look the request up (counting its hits by tier), then store or use its blocks."""
        keys = [BlockKey(h.to_bytes(8, "little", signed=True)) for h in request.hash_ids]
        leading = self._lookup(keys, request.input_length)
        keep = set(keys)
        for i, key in enumerate(keys):
            if key in self.host:
                self.host.policy.touch(key)
            elif self.disk is None or key not in self.disk:
                self._admit(key, keep)
                if self.through:
                    self._write(key, keep)
                    self.moves.written += 1
            elif i < leading:
                self._promote(self.disk, key, keep)
            else:
                self.disk.policy.touch(key)

    def _lookup(self, keys: Sequence[BlockKey], input_length: int) -> int:
        """Count the tokens the leading present blocks serve from each tier; how many
        blocks lead."""
        for i, key in enumerate(keys):
            tokens = max(0, min(TRACE_BLOCK_TOKENS, input_length - i * TRACE_BLOCK_TOKENS))
            if key in self.host:
                self.moves.host_hit_tokens += tokens
                self.moves.host_hit_blocks += 1
            elif self.disk is not None and key in self.disk:
                self.moves.disk_hit_tokens += tokens
                self.moves.disk_hit_blocks += 1
            else:
                return i
        return len(keys)

    def _promote(self, disk: _Tier, key: BlockKey, keep: set[BlockKey]) -> None:
        """Copy a disk hit up (the store's ``use``): a persistent tier keeps its copy and
        counts a use; a memory tier gives its slot up first."""
        if self.persistent:
            self._admit(key, keep)
            disk.policy.touch(key)
        else:
            disk.take(key)
            self._admit(key, keep)
        self.host.policy.touch(key)  # the put after the get finds it in the host
        self.moves.promoted += 1

    def _admit(self, key: BlockKey, keep: set[BlockKey]) -> None:
        """Store ``key`` in the host, demoting the host's victim if it is full."""
        if self.host.full():
            self._demote(self.host.evict(keep), keep)
        self.host.add(key)

    def _demote(self, key: BlockKey, keep: set[BlockKey]) -> None:
        disk = self.disk
        if disk is None:
            self.moves.evicted += 1
            return
        if key in disk:  # its copy is still there: nothing to write
            return
        self._write(key, keep)
        self.moves.demoted += 1

    def _write(self, key: BlockKey, keep: set[BlockKey]) -> None:
        """Write ``key`` to the disk, dropping the disk's coldest block if it is full."""
        disk = self.disk
        assert disk is not None
        if disk.full():
            dropped = disk.evict(keep)
            if dropped not in self.host:
                self.moves.evicted += 1
        disk.add(key)


def replay_tiers(
    requests: Sequence[TraceRequest],
    host_tokens: float,
    disk_tokens: float,
    policy: str,
    *,
    from_request: int = 0,
    costs: Costs = Costs(),
    persistent: bool = True,
    write_through: bool = True,
) -> TierReplayResult:
    """Hit rate of ``requests`` through a host tier of ``host_tokens`` over a disk tier of
    ``disk_tokens`` (0: none) under ``policy`` (a name in ``POLICIES``), by tier. Requests
    before ``from_request`` only warm the tiers. ``write_through`` (as ``kvbridge serve``):
    each new block is written to the disk as it is stored; without it, when the host
    demotes it. ``persistent=False`` makes the lower tier a memory tier (nothing written
    through): a promotion moves the block, and the two tiers never hold one block twice
    (with ``lru`` they are then exactly one LRU cache of both capacities)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; the tiers run {sorted(POLICIES)}")
    disk_blocks = _blocks(disk_tokens) if disk_tokens else 0
    tiers = _TwoTiers(
        _blocks(host_tokens), disk_blocks, policy, persistent=persistent, through=write_through
    )
    for t, request in enumerate(requests):
        if t == from_request:
            tiers.moves = _Moves()
        tiers.serve(request)
    return _result(
        tiers.moves,
        policy=policy,
        capacities=(int(host_tokens), int(disk_tokens)),
        counted=requests[from_request:],
        costs=costs,
        write_through=tiers.through,
    )


def _result(
    moves: _Moves,
    *,
    policy: str,
    capacities: tuple[int, int],
    counted: Sequence[TraceRequest],
    costs: Costs,
    write_through: bool,
) -> TierReplayResult:
    prompt_tokens = sum(r.input_length for r in counted)
    host_bytes = moves.host_hit_tokens * costs.bytes_per_token
    disk_bytes = moves.disk_hit_tokens * costs.bytes_per_token
    hits = moves.host_hit_tokens + moves.disk_hit_tokens
    return TierReplayResult(
        policy=policy,
        host_capacity_tokens=capacities[0],
        disk_capacity_tokens=capacities[1],
        hit_rate=_share(hits, prompt_tokens),
        host_hit_rate=_share(moves.host_hit_tokens, prompt_tokens),
        disk_hit_rate=_share(moves.disk_hit_tokens, prompt_tokens),
        hit_tokens=hits,
        host_hit_tokens=moves.host_hit_tokens,
        disk_hit_tokens=moves.disk_hit_tokens,
        prompt_tokens=prompt_tokens,
        requests=len(counted),
        host_hit_blocks=moves.host_hit_blocks,
        disk_hit_blocks=moves.disk_hit_blocks,
        promoted_blocks=moves.promoted,
        demoted_blocks=moves.demoted,
        evicted_blocks=moves.evicted,
        written_blocks=moves.written,
        promoted_bytes=moves.promoted * costs.block_bytes,
        demoted_bytes=moves.demoted * costs.block_bytes,
        written_bytes=moves.written * costs.block_bytes,
        host_hit_bytes=host_bytes,
        disk_hit_bytes=disk_bytes,
        host_hit_seconds=host_bytes * 8 / (costs.link_gbps * 1e9),
        disk_hit_seconds=disk_bytes * 8 / (costs.disk_gbps * 1e9),
        bytes_per_token=costs.bytes_per_token,
        link_gbps=costs.link_gbps,
        disk_gbps=costs.disk_gbps,
        write_through=write_through,
    )


def table(results: Sequence[TierReplayResult]) -> str:
    """The results as a table: hit rates (of all prompt tokens) by tier, beside one cache of
    both tiers and of the disk alone where they were replayed; what moved between and into
    the tiers, in GB (10^9 bytes: promoted, demoted, written through); the seconds the hits
    take to move from each tier; the block size and rates under it."""
    lines = [
        f"{'host':>11} {'disk':>11}  {'policy':8s} {'hit rate':>8} {'host':>7} {'disk':>7}"
        f" {'one cache':>9} {'disk alone':>10} {'promoted':>9} {'demoted':>9} {'written':>9}"
        f" {'link s':>8} {'disk s':>8}"
    ]
    for r in results:
        lines.append(
            f"{r.host_capacity_tokens:>11,} {r.disk_capacity_tokens:>11,}  {r.policy:8s}"
            f" {r.hit_rate:8.4f} {r.host_hit_rate:7.4f} {r.disk_hit_rate:7.4f}"
            f" {_rate(r.one_cache_hit_rate):>9} {_rate(r.disk_alone_hit_rate):>10}"
            f" {r.promoted_bytes / 1e9:9.1f} {r.demoted_bytes / 1e9:9.1f}"
            f" {r.written_bytes / 1e9:9.1f}"
            f" {r.host_hit_seconds:8.2f} {r.disk_hit_seconds:8.2f}"
        )
    if results:
        r = results[0]
        through = "written through to the disk" if r.write_through else "written back"
        lines.append(
            f"KV {r.bytes_per_token:,} bytes per token ({r.bytes_per_token * TRACE_BLOCK_TOKENS:,}"
            f" per block); hits over a {r.link_gbps:g} Gbit/s link from the host, read at"
            f" {r.disk_gbps:g} Gbit/s from the disk; new blocks {through}"
        )
    return "\n".join(lines)


def _rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.4f}"


def _blocks(tokens: float) -> int:
    blocks = int(tokens // TRACE_BLOCK_TOKENS)
    if blocks < 1:
        raise ValueError(f"a capacity of {tokens:g} tokens holds no 512-token block")
    return blocks


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0
