"""Hybrid models through the connector with vLLM's hybrid KV cache manager kept on, on the
real vLLM (CPU), with small random-weight models the tests build (``tiny.py``):

- a Gemma-3 shape (sliding window of 64 on layers 0 and 2, full attention on 1 and 3):
  vLLM keeps its two KV cache groups with the connector as without it; greedy outputs
  equal vLLM's own, first run and a fresh process's; the fresh process loads every
  loadable block of every group (the full group's prefix, the window group's tail); a
  dead server and a load failure in one group both leave outputs equal;
- a Qwen3-Next shape (gated delta-net on layers 0 and 2): vLLM starts and serves with the
  connector, outputs equal, no external hit, nothing saved, and the log says why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from harness import BLOCK, PROMPTS, run_engine, spec, tokens
from helpers import free_port
from serve import ServeProcess
from tiny import make_gemma3, make_qwen3_next

WINDOW = 64


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_gemma3(tmp_path_factory.mktemp("gemma3"), window=WINDOW))


@pytest.fixture(scope="module")
def gemma_alone(gemma: str) -> dict[str, Any]:
    return run_engine({"model": gemma, "prompts": PROMPTS, "connector": None})


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_qwen3_next(tmp_path_factory.mktemp("qwen3next")))


def _loadable(prompts: list[list[int]], window: int) -> int:
    """Tokens a fresh engine loads when every full prompt block was saved: the full group
    all of a prompt's loadable blocks, the window group those still inside the window at
    the end of the hit (vLLM keeps its null block in the places before)."""
    total = 0
    for prompt in prompts:
        blocks = min(len(prompt) - 1, len(prompt) // BLOCK * BLOCK) // BLOCK
        kept = blocks - max(0, blocks * BLOCK - window + 1) // BLOCK
        total += (blocks + kept) * BLOCK
    return total


def test_a_sliding_window_model_keeps_its_groups_and_hits_in_every_group(
    gemma: str, gemma_alone: dict[str, Any]
) -> None:
    assert gemma_alone["kv_cache"]["groups"] == ["SlidingWindowSpec", "FullAttentionSpec"]
    server = ServeProcess("--host-capacity", "64MiB", "--events-port", "0")
    try:
        connector = {"server": server.address}
        first = run_engine(spec(gemma, connector))
        assert first["kv_cache"] == gemma_alone["kv_cache"]  # the groups, and as many blocks
        assert tokens(first) == tokens(gemma_alone)
        assert first["stats"]["tokens_saved"] > 0
        second = run_engine(spec(gemma, connector, ready=60))
        assert second["ready"] is True
        assert tokens(second) == tokens(gemma_alone)
        assert second["stats"]["tokens_loaded"] == _loadable(PROMPTS, WINDOW)
        assert "hybrid kv cache manager" not in second["log"].lower()
    finally:
        server.kill()


def test_a_sliding_window_model_with_a_dead_server_gives_equal_outputs(
    gemma: str, gemma_alone: dict[str, Any]
) -> None:
    run = run_engine(spec(gemma, {"server": f"127.0.0.1:{free_port()}", "timeout": 2}))
    assert tokens(run) == tokens(gemma_alone)
    assert run["kv_cache"] == gemma_alone["kv_cache"]


def test_a_load_failure_in_one_group_recomputes_the_whole_hit(
    gemma: str, gemma_alone: dict[str, Any], tmp_path: Path
) -> None:
    """Of each request's two loads (one per group) every second one fails: the request
    is reported failed as a whole (vLLM recomputes it), never served with one group's
    blocks loaded and the other's not."""
    server = ServeProcess("--host-capacity", "64MiB")
    try:
        connector = {"server": server.address}
        assert tokens(run_engine(spec(gemma, connector))) == tokens(gemma_alone)
        faulty = spec(gemma, connector, faulty_loads=True, failure_policy="recompute")
        env = {"PYTHONPATH": str(Path(__file__).parent), "KVB_FAIL_EVERY_OTHER_LOAD": "1"}
        result = run_engine(faulty, env=env, timeout=240)
        assert tokens(result) == tokens(gemma_alone)
        assert result["stats"]["load_failures"] >= 1
    finally:
        server.kill()


def test_a_linear_attention_model_starts_and_serves_with_no_external_hit(
    qwen3_next: str,
) -> None:
    alone = run_engine(
        {"model": qwen3_next, "prompts": PROMPTS, "connector": None, "dtype": "bfloat16"}
    )
    assert alone["kv_cache"]["groups"] == ["MambaSpec", "FullAttentionSpec"]
    server = ServeProcess("--host-capacity", "64MiB")
    try:
        connector = {"server": server.address}
        for _ in range(2):  # a second engine would load what the first saved: nothing
            run = run_engine(spec(qwen3_next, connector, dtype="bfloat16"))
            assert run["kv_cache"] == alone["kv_cache"]
            assert tokens(run) == tokens(alone)
            assert run["stats"].get("tokens_loaded", 0) == 0
            assert run["stats"].get("tokens_saved", 0) == 0
        assert "loads and saves nothing for it" in run["log"]
    finally:
        server.kill()
