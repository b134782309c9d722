"""`kvbridge replay` against the reference hit rates published with the Mooncake traces
(tests/data/traces/README.md says where the traces come from), and the `reuse` and `arc`
eviction policies."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import keys, payloads

from kvbridge.store import BlockKey, TieredStore
from kvbridge.store.local import ReuseLRU
from kvbridge.tools._replay import TraceRequest, load_requests, parse_tokens, replay

TRACES = Path(__file__).parent / "data" / "traces"
CONVERSATION = TRACES / "conversation_first6000.jsonl"
SYNTHETIC = TRACES / "synthetic.jsonl"
needs_traces = pytest.mark.skipif(
    not CONVERSATION.exists(), reason=f"the Mooncake traces are not at {TRACES}"
)


@pytest.mark.slow
@needs_traces
@pytest.mark.parametrize(
    ("trace", "capacity", "policy", "expected"),
    [
        (CONVERSATION, float("inf"), "lru", 0.353),
        (CONVERSATION, 3e6, "lru", 0.141),
        (CONVERSATION, 1e6, "lru", 0.053),
        (CONVERSATION, 3e6, "belady", 0.343),
        (SYNTHETIC, float("inf"), "lru", 0.651),
        (SYNTHETIC, 3e6, "lru", 0.315),
        (SYNTHETIC, 1e6, "lru", 0.142),
        (SYNTHETIC, 3e6, "belady", 0.556),
    ],
)
def test_reference_figures(trace: Path, capacity: float, policy: str, expected: float) -> None:
    result = replay(load_requests(str(trace)), capacity, policy)
    assert round(result.hit_rate, 3) == expected


@pytest.mark.slow
@needs_traces
def test_reuse_policy_beats_lru() -> None:
    conversation = load_requests(str(CONVERSATION))
    synthetic = load_requests(str(SYNTHETIC))
    for requests, gain in ((conversation, 1.25), (synthetic, 1.05)):
        lru = replay(requests, 3e6, "lru").hit_rate
        assert replay(requests, 3e6, "reuse").hit_rate >= gain * lru
    for capacity in (1e6, 6e6):  # and never loses to LRU at other sizes
        for requests in (conversation, synthetic):
            lru = replay(requests, capacity, "lru").hit_rate
            assert replay(requests, capacity, "reuse").hit_rate >= lru


def test_from_request_counts_only_later_requests(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
        {"timestamp": 1, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 3]},
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    requests = load_requests(str(trace))
    whole = replay(requests, 1e6, "lru")
    assert whole.hit_tokens == 1024 and whole.prompt_tokens == 2124
    warmed = replay(requests, 1e6, "lru", from_request=1)
    assert warmed.hit_rate == 1024 / 1100 and warmed.requests == 1
    tiny = replay(requests, 1024, "lru")  # two blocks: request 2's third block evicts block 1
    assert tiny.hit_tokens == 1024
    with pytest.raises(ValueError, match="holds no"):
        replay(requests, 100, "lru")
    assert parse_tokens("3M") == 3e6 and parse_tokens("500k") == 5e5
    with pytest.raises(ValueError):
        parse_tokens("lots")


@pytest.mark.slow
def test_replay_command(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        json.dumps({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]})
        + "\n"
    )
    base = [sys.executable, "-m", "kvbridge", "replay"]
    listed = subprocess.run([*base, "--list-policies"], capture_output=True, text=True, check=True)
    assert all(name in listed.stdout for name in ("reuse", "arc", "belady"))
    done = subprocess.run(
        [*base, str(trace), "--capacity", "1M", "--policy", "lru", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(done.stdout)[0]["hit_rate"] == 0.0
    bad = subprocess.run(
        [*base, str(trace), "--policy", "nope"], capture_output=True, text=True, check=False
    )
    assert bad.returncode == 2 and "unknown policy" in bad.stderr
    plot = tmp_path / "sweep.png"
    swept = subprocess.run(
        [*base, str(trace), "--sweep", str(plot)], capture_output=True, text=True, check=False
    )
    if swept.returncode == 0:
        assert plot.stat().st_size > 1000
    else:
        assert "matplotlib" in swept.stderr


def _key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


def test_reuse_policy_evicts_new_blocks_before_reused_ones() -> None:
    policy = ReuseLRU()
    for i in range(4):
        policy.insert(_key(i))
    policy.touch(_key(0))  # 0 was reused
    assert list(policy.candidates()) == [_key(1), _key(2), _key(3), _key(0)]
    policy.remove(_key(1))
    policy.insert(_key(1))  # back within the ghost history: a reuse
    assert list(policy.candidates())[-2:] == [_key(0), _key(1)]


def test_a_reused_block_unused_for_long_loses_its_protection() -> None:
    policy = ReuseLRU()
    policy.insert(_key(0))
    policy.touch(_key(0))
    for i in range(1, 4):
        policy.insert(_key(i))
    assert next(policy.candidates()) == _key(1)
    for round_ in range(ReuseLRU.PROTECT * 4 + 4):  # churn: 4 keys, 8 x 4 accesses later
        policy.touch(_key(1 + round_ % 3))
    assert next(policy.candidates()) == _key(0)


def test_arc_keeps_a_reused_set_that_scans_flush_from_lru() -> None:
    """60 blocks used twice, then in every round used again after a scan of 50 blocks used
    once, through a cache of 100 blocks: LRU drops each one before its next use (109 other
    blocks come between), ARC keeps them in its list of reused blocks and lets the scan
    run through its list of blocks used once."""
    hot = [TraceRequest(512, (h,)) for h in range(60)]
    requests = hot + hot
    for round_ in range(20):
        requests += hot + [TraceRequest(512, (1000 + 50 * round_ + i,)) for i in range(50)]
    lru = replay(requests, 100 * 512, "lru", from_request=120)
    arc = replay(requests, 100 * 512, "arc", from_request=120)
    assert arc.hit_tokens == 20 * 60 * 512  # every reuse of the set, and nothing else
    assert lru.hit_rate < 0.05 and arc.hit_rate > 0.5


def test_the_store_runs_the_reuse_policy() -> None:
    bb = 4096
    with TieredStore(bb, host_capacity=3 * bb, policy="reuse") as store:
        ks = keys(0, 5)
        store.put(ks[:3], payloads(ks[:3], bb))
        store.get(ks[:1], np.zeros((1, bb), np.uint8))  # block 0 is reused
        store.put(ks[3:5], payloads(ks[3:5], bb))  # evicts the two new blocks 1 and 2
        assert store.contains(ks) == [True, False, False, True, True]


@pytest.mark.slow
@needs_traces
def test_policy_bounds_study(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """benches/policy_bounds.py: its rows, its LRU equal to replay's, and the density
    policy never leaves a cached block without its cached prefix."""
    spec = importlib.util.spec_from_file_location(
        "policy_bounds", Path(__file__).parents[1] / "benches" / "policy_bounds.py"
    )
    assert spec is not None and spec.loader is not None
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    trace = tmp_path / "head.jsonl"
    trace.write_text("".join(SYNTHETIC.read_text().splitlines(keepends=True)[:800]))
    assert study.main([str(trace), "--capacity", "200k"]) == 0
    rows = dict(line.split()[:2] for line in capsys.readouterr().out.splitlines())
    requests = load_requests(str(trace))
    assert float(rows["lru"]) == pytest.approx(replay(requests, 2e5, "lru").hit_rate, abs=1e-4)
    assert float(rows["oracle-keep"]) > float(rows["lru"])
    assert len(rows) == 9
    classes = study._classes(requests, ("f", "len"))
    tables = study._densities(requests, classes, horizon=3000)
    cache = study._ClassDensity(390, classes, tables)
    for request in requests:
        cache.request(request.hash_ids)
        assert len(cache.present) <= 390
        for block in cache.present.values():
            assert block.parent is None or block.parent in cache.present
