"""Faults on a real vLLM: loads that fail under both load-failure policies, and
preemption forced by a small KV cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness import LOADABLE, prompts, run_engine, spec, tokens

HERE = Path(__file__).parent
ENV = {"PYTHONPATH": str(HERE)}  # the faulty connector's module, in the engine process


def _cached(model: str, tmp_path: Path) -> dict[str, Any]:
    """An in-process store on disk that a first run filled with every prompt's blocks."""
    store: dict[str, Any] = {"host_capacity": "16MiB", "disk_capacity": "64MiB"}
    store["disk_path"] = str(tmp_path / "kv")
    run_engine(spec(model, store))
    return store


def test_failed_loads_under_recompute_are_recomputed_once(
    model: str, baseline: list[list[int]], tmp_path: Path
) -> None:
    """Every load fails: vLLM recomputes the blocks, outputs stay equal, and the connector
    stops advertising the failed keys (no livelock: each key fails at most once)."""
    store = _cached(model, tmp_path)
    run = spec(model, store, faulty_loads=True, failure_policy="recompute", rounds=2)
    result = run_engine(run, env=ENV, timeout=240)
    assert tokens(result, 0) == baseline and tokens(result, 1) == baseline
    stats = result["stats"]
    assert stats["load_failures"] >= 1 and stats["tokens_loaded"] == 0
    # Each request's load fails once; the second round is not offered the failed keys (a
    # connector that offered them again would fail them again: twice as many).
    assert stats["tokens_load_failed"] <= LOADABLE


def test_failed_loads_under_fail_end_in_error_never_wrong_tokens(
    model: str, baseline: list[list[int]], tmp_path: Path
) -> None:
    store = _cached(model, tmp_path)
    run = spec(model, store, faulty_loads=True, failure_policy="fail")
    result = run_engine(run, env=ENV, timeout=240)
    for out, expected in zip(result["rounds"][0], baseline, strict=True):
        if out["finish"] == "error":
            continue  # what failed says so
        assert out["tokens"] == expected  # what did not fail is right
    assert any(out["finish"] == "error" for out in result["rounds"][0])


def test_preemption_keeps_outputs_equal(model: str) -> None:
    """A KV cache of 17 blocks for 4 requests that need 29: vLLM preempts and resumes them.
    Saves of a preempted request end before its blocks are reused, and a resumed request
    loads its saved prompt blocks instead of computing them again."""
    long = prompts(3)[:4]
    base = {"model": model, "prompts": long, "max_tokens": 120, "blocks": 17, "connector": None}
    expected = tokens(run_engine(base))
    result = run_engine({**base, "connector": {"host_capacity": "64MiB"}})
    assert tokens(result) == expected
    assert result["stats"]["tokens_loaded"] > 0  # resumed requests loaded their prefix
    assert "preempt" in result["log"].lower() or result["stats"]["tokens_loaded"] > 0


def test_failed_async_loads_under_recompute_do_not_livelock(
    model: str, baseline: list[list[int]], tmp_path: Path
) -> None:
    """The case vLLM's own tests saw livelock: a persistent async load failure under
    recompute. The failed keys are not offered again, so each request fails once."""
    store = {**_cached(model, tmp_path), "async_load": True}
    run = spec(model, store, faulty_loads=True, failure_policy="recompute", rounds=2)
    result = run_engine(run, env=ENV, timeout=240)
    assert tokens(result, 0) == baseline and tokens(result, 1) == baseline
    assert result["stats"]["load_failures"] >= 1 and result["stats"]["tokens_loaded"] == 0
    assert result["stats"]["tokens_load_failed"] <= LOADABLE
