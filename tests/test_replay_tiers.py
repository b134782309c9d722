"""`kvbridge replay --host-capacity H --disk-capacity D`: a trace through a host tier over a
disk tier, as a TieredStore places blocks, new blocks written through to the disk as
`kvbridge serve` writes them or (`--write-back`) only once demoted (tools/_replay_tiers.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbridge.tools._replay import TraceRequest, load_requests, replay
from kvbridge.tools._replay_tiers import Costs, TierReplayResult, replay_tiers
from kvbridge.tools.cli import main

TRACES = Path(__file__).parent / "data" / "traces"
CONVERSATION = TRACES / "conversation_first6000.jsonl"
SYNTHETIC = TRACES / "synthetic.jsonl"
needs_traces = pytest.mark.skipif(
    not CONVERSATION.exists(), reason=f"the Mooncake traces are not at {TRACES}"
)
POLICIES = ("lru", "reuse", "arc")

# Host 2 blocks over disk 3 blocks, LRU, written back: every step of this trace is worked out
# in test_a_small_trace_moves_exactly_as_worked_out_by_hand.
SMALL = [
    TraceRequest(1024, (1, 2)),
    TraceRequest(1024, (3, 4)),  # 1 and 2 demoted
    TraceRequest(1000, (1, 2)),  # both disk hits, promoted; 3 and 4 demoted, 3 drops
    TraceRequest(512, (5,)),  # host victim 1 still on disk: nothing written
    TraceRequest(1024, (1, 3)),  # 1 a disk hit (promoted; 2 leaves host), 3 new: 5 down, 4 out
    TraceRequest(1024, (2, 5)),  # both disk hits; 1 and 3 leave the host, 1 leaves the store
    TraceRequest(512, (2,)),  # a host hit
]


def _consistent(r: TierReplayResult) -> None:
    """What every replay by tier must add up to."""
    assert r.hit_tokens == r.host_hit_tokens + r.disk_hit_tokens
    assert r.hit_rate == pytest.approx(r.host_hit_rate + r.disk_hit_rate)
    assert r.promoted_blocks == r.disk_hit_blocks  # nothing pinned: every disk hit goes up
    assert r.promoted_bytes == r.promoted_blocks * 512 * r.bytes_per_token
    assert r.demoted_bytes == r.demoted_blocks * 512 * r.bytes_per_token
    assert r.host_hit_bytes == r.host_hit_tokens * r.bytes_per_token
    assert r.host_hit_seconds == pytest.approx(r.host_hit_bytes * 8 / (r.link_gbps * 1e9))
    assert r.disk_hit_seconds == pytest.approx(r.disk_hit_bytes * 8 / (r.disk_gbps * 1e9))
    assert r.written_bytes == r.written_blocks * 512 * r.bytes_per_token
    assert r.write_through or r.written_blocks == 0
    disk_writes = r.demoted_blocks + r.written_blocks
    assert r.evicted_blocks <= disk_writes or r.disk_capacity_tokens == 0


def test_a_small_trace_moves_exactly_as_worked_out_by_hand() -> None:
    r = replay_tiers(SMALL, 1024, 1536, "lru", costs=Costs(bytes_per_token=10), write_through=False)
    assert (r.host_hit_tokens, r.disk_hit_tokens, r.prompt_tokens) == (512, 2536, 6120)
    assert (r.host_hit_blocks, r.disk_hit_blocks) == (1, 5)
    assert (r.promoted_blocks, r.demoted_blocks, r.evicted_blocks) == (5, 6, 3)
    assert (r.promoted_bytes, r.disk_hit_bytes) == (5 * 5120, 25_360)
    _consistent(r)
    later = replay_tiers(SMALL, 1024, 1536, "lru", from_request=4, write_through=False)
    assert (later.host_hit_tokens, later.disk_hit_tokens, later.requests) == (512, 1536, 3)
    assert (later.promoted_blocks, later.demoted_blocks, later.evicted_blocks) == (3, 2, 2)


def test_without_a_disk_the_host_is_the_one_tier_cache() -> None:
    requests = [TraceRequest(2048, (i % 7, i % 5 + 10, i % 3 + 20)) for i in range(200)]
    for policy in POLICIES:
        alone = replay_tiers(requests, 2048, 0, policy)
        assert alone.hit_rate == replay(requests, 2048, policy).hit_rate
        assert (alone.disk_hit_tokens, alone.promoted_blocks, alone.demoted_blocks) == (0, 0, 0)
        _consistent(alone)


def test_a_memory_lower_tier_moves_its_hits_up() -> None:
    """``persistent=False``: the tiers are exclusive, so no host victim finds its copy
    below, and with LRU the pair is one cache of both sizes."""
    requests = [TraceRequest(1536, (i % 9, i % 4 + 10, i % 11 + 20)) for i in range(300)]
    moved = replay_tiers(requests, 1024, 2048, "lru", persistent=False)
    assert moved.hit_rate == replay(requests, 3072, "lru").hit_rate
    _consistent(moved)


def _replay_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str
) -> tuple[int, str, str]:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": t, "input_length": r.input_length, "hash_ids": r.hash_ids})
            + "\n"
            for t, r in enumerate(SMALL)
        )
    )
    status = main(["replay", str(trace), *flags])
    out, err = capsys.readouterr()
    return status, out, err


def test_the_command_prints_the_tiers_as_json_and_as_a_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ("--host-capacity", "1024", "--disk-capacity", "1536", "--policy", "lru")
    status, out, _ = _replay_cli(
        tmp_path, capsys, *flags, "--json", "--bytes-per-token", "10", "--write-back"
    )
    assert status == 0
    (row,) = json.loads(out)
    back = replay_tiers(
        SMALL, 1024, 1536, "lru", costs=Costs(bytes_per_token=10), write_through=False
    )
    both, alone = replay(SMALL, 2560, "lru").hit_rate, replay(SMALL, 1536, "lru").hit_rate
    assert row == {**back.__dict__, "one_cache_hit_rate": both, "disk_alone_hit_rate": alone}
    status, out, _ = _replay_cli(tmp_path, capsys, *flags, "--policy", "arc", "--link-gbps", "25")
    lines = out.splitlines()
    assert status == 0 and len(lines) == 4
    through = replay_tiers(SMALL, 1024, 1536, "lru")
    assert through.write_through and through.written_blocks > 0
    assert lines[1].split()[:8] == [
        "1,024",
        "1,536",
        "lru",
        f"{through.hit_rate:.4f}",
        f"{through.host_hit_rate:.4f}",
        f"{through.disk_hit_rate:.4f}",
        f"{both:.4f}",
        f"{alone:.4f}",
    ]
    assert "131,072 bytes per token" in lines[3] and "25 Gbit/s link" in lines[3]
    assert lines[3].endswith("new blocks written through to the disk")


_BAD_FLAGS = {
    "disk without host": (["--disk-capacity", "4M"], "needs a --host-capacity"),
    "one disk for two hosts": (
        ["--host-capacity", "1M", "--host-capacity", "2M", "--disk-capacity", "4M"],
        "one --disk-capacity per --host-capacity",
    ),
    "one tier and tiers": (["--capacity", "1M", "--host-capacity", "1M"], "give one of them"),
    "belady by tier": (["--host-capacity", "1M", "--policy", "belady"], "one cache's optimum"),
    "sweep by tier": (["--host-capacity", "1M", "--sweep", "x.png"], "--sweep draws one"),
    "tier smaller than a block": (["--host-capacity", "100"], "holds no 512-token block"),
    "cache smaller than a block": (["--capacity", "100"], "holds no 512-token block"),
    "zero link": (["--host-capacity", "1M", "--link-gbps", "0"], "--link-gbps must be"),
    "nan disk": (["--host-capacity", "1M", "--disk-gbps", "nan"], "--disk-gbps must be"),
    "negative bytes": (["--host-capacity", "1M", "--bytes-per-token", "-1"], "must be"),
    "rates of one cache": (["--capacity", "1M", "--link-gbps", "10"], "for a replay by tier"),
    "bad size": (["--host-capacity", "1M", "--disk-capacity", "lots"], "not a token count"),
    "write-back of one cache": (["--capacity", "1M", "--write-back"], "for a replay by tier"),
}


@pytest.mark.parametrize(("flags", "says"), list(_BAD_FLAGS.values()), ids=list(_BAD_FLAGS))
def test_bad_tier_flags_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], says: str
) -> None:
    status, out, err = _replay_cli(tmp_path, capsys, *flags)
    assert status == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("kvbridge replay: ") and says in err


@pytest.fixture(scope="module")
def traces() -> dict[str, list[TraceRequest]]:
    return {path.stem: load_requests(str(path)) for path in (CONVERSATION, SYNTHETIC)}


@pytest.mark.slow
@needs_traces
@pytest.mark.parametrize("policy", POLICIES)
def test_written_back_a_host_over_a_disk_hits_between_one_cache_of_the_disk_and_of_both(
    traces: dict[str, list[TraceRequest]], policy: str
) -> None:
    """1M + 4M tokens against one cache of 4M and of 5M. The disk keeps a copy of every
    block it promotes, so the two tiers hold fewer distinct blocks than 5M tokens (on
    average 0.15M / 0.28M tokens fewer, conversation / synthetic, measured under LRU),
    and the disk ranks such a block by its promotion, not by its last use: 0.010-0.032
    below one 5M cache. Made exclusive (``persistent=False``, as memory tiers are) the
    pair is exactly one 5M LRU cache; ``reuse`` and ``arc`` run one instance per tier,
    each seeing only its own tier's history, and come within 0.006 of it (0.01 allowed)."""
    for requests in traces.values():
        tiered = replay_tiers(requests, 1e6, 4e6, policy, write_through=False)
        _consistent(tiered)
        assert tiered.host_hit_rate > 0 and tiered.disk_hit_rate > 0
        one_disk, one_both = replay(requests, 4e6, policy), replay(requests, 5e6, policy)
        assert one_disk.hit_rate < tiered.hit_rate < one_both.hit_rate
        exclusive = replay_tiers(requests, 1e6, 4e6, policy, persistent=False)
        _consistent(exclusive)
        tolerance = 0.0 if policy == "lru" else 0.01
        assert exclusive.hit_rate == pytest.approx(one_both.hit_rate, abs=tolerance)


@pytest.mark.slow
@needs_traces
def test_a_host_tier_alone_is_the_one_tier_replay(traces: dict[str, list[TraceRequest]]) -> None:
    """Under LRU exactly (a request's own blocks are never the coldest); ``reuse`` and
    ``arc`` differ a little, as their tiers pass over the request's own blocks as the
    store does and the one-tier replay does not."""
    for requests in traces.values():
        for policy in POLICIES:
            alone = replay_tiers(requests, 3e6, 0, policy).hit_rate
            one_tier = replay(requests, 3e6, policy).hit_rate
            assert alone == one_tier if policy == "lru" else abs(alone - one_tier) < 0.005


@pytest.mark.slow
@needs_traces
def test_written_through_a_host_over_a_disk_hits_as_one_cache_of_the_disk(
    traces: dict[str, list[TraceRequest]],
) -> None:
    """As ``kvbridge serve`` stores blocks: the disk holds every block the host does, so
    1M + 4M tokens hit as one 4M cache, within the three policies' own spread there (one
    cache of 5M would need the tiers to hold no block twice). The host serves part of those
    hits, and nothing is demoted under LRU (a host victim's copy is always on the disk)."""
    for requests in traces.values():
        alone = {policy: replay(requests, 4e6, policy).hit_rate for policy in POLICIES}
        spread = max(alone.values()) - min(alone.values())
        for policy in POLICIES:
            tiered = replay_tiers(requests, 1e6, 4e6, policy)
            _consistent(tiered)
            assert tiered.write_through and tiered.written_blocks > 0
            assert tiered.host_hit_rate > 0 and tiered.disk_hit_rate > 0
            assert abs(tiered.hit_rate - alone[policy]) <= spread
            assert tiered.hit_rate < replay(requests, 5e6, policy).hit_rate
            assert tiered.demoted_blocks == 0 or policy != "lru"


def test_a_memory_lower_tier_is_never_written_through() -> None:
    requests = [TraceRequest(1536, (i % 9, i % 4 + 10, i % 11 + 20)) for i in range(300)]
    moved = replay_tiers(requests, 1024, 2048, "lru", persistent=False, write_through=True)
    assert not moved.write_through and moved.written_blocks == 0
    assert moved.hit_rate == replay(requests, 3072, "lru").hit_rate
