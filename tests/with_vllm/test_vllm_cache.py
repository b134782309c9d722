"""The connector as a shared prefix cache on a real vLLM: outputs equal to vLLM without a
connector, and a fresh instance loads what an earlier one saved."""

from __future__ import annotations

from pathlib import Path

from harness import LOADABLE, run_engine, spec, tokens


def test_in_process_cache_equal_outputs_and_loads(model: str, baseline: list[list[int]]) -> None:
    """One instance, vLLM's own prefix cache off: the second round loads every full prompt
    block from kvbridge's host memory, and both rounds equal vLLM without a connector."""
    result = run_engine(spec(model, {"host_capacity": "64MiB"}, rounds=2))
    assert tokens(result, 0) == baseline
    assert tokens(result, 1) == baseline
    stats = result["stats"]
    assert stats["tokens_loaded"] >= LOADABLE  # round 2 alone loads LOADABLE
    assert stats["load_failures"] == 0 and stats["store_faults"] == 0


def test_in_process_cache_survives_a_restart_on_disk(
    model: str, baseline: list[list[int]], tmp_path: Path
) -> None:
    store = {"host_capacity": "16MiB", "disk_path": str(tmp_path / "kv"), "disk_capacity": "64MiB"}
    first = run_engine(spec(model, store))
    assert tokens(first) == baseline and first["stats"]["tokens_saved"] > 0
    second = run_engine(spec(model, store))
    assert tokens(second) == baseline
    assert second["stats"]["tokens_loaded"] == LOADABLE


def test_prefix_caching_on_loads_only_past_the_local_hit(
    model: str, baseline: list[list[int]]
) -> None:
    """With vLLM's own prefix cache on, a request loads only the blocks past its local hit
    (the earlier ones already hold valid KV) and outputs stay equal."""
    result = run_engine(spec(model, {"host_capacity": "64MiB"}, rounds=2, prefix_caching=True))
    assert tokens(result, 0) == baseline and tokens(result, 1) == baseline


def test_in_process_cache_with_scheduler_and_worker_in_two_processes(
    model: str, baseline: list[list[int]]
) -> None:
    """vLLM's default (as ``vllm serve`` runs): the worker runs the store's server, the
    scheduler finds it through vLLM's handshake metadata, and round 2 is served from it."""
    result = run_engine(spec(model, {"host_capacity": "64MiB"}, rounds=2, multiprocessing=True))
    assert tokens(result, 0) == baseline and tokens(result, 1) == baseline
    assert sum(out["cached"] for out in result["rounds"][1]) == LOADABLE


def test_async_loads_off_the_step_equal_outputs(model: str, baseline: list[list[int]]) -> None:
    """``async_load``: the request waits for its load (WAITING_FOR_REMOTE_KVS) while the
    engine runs; round 2 loads every loadable block, outputs equal."""
    store = {"host_capacity": "64MiB", "async_load": True}
    result = run_engine(spec(model, store, rounds=2))
    assert tokens(result, 0) == baseline and tokens(result, 1) == baseline
    assert sum(out["cached"] for out in result["rounds"][1]) == LOADABLE
    assert result["stats"]["load_failures"] == 0
