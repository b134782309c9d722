"""The staged path on a real vLLM 0.32 (CPU): ``staging: "always"`` moves every page
through the host staging buffer, as a KV cache in GPU memory goes, here with a buffer of two
blocks (32 KiB each) so that every load and save runs in chunks. Outputs equal an instance
without a connector, a fresh instance loads what another saved, and a server killed mid-run
costs recomputation only. (P/D runs staged too: ``test_vllm_pd.py``.)"""

from __future__ import annotations

from typing import Any

from harness import LOADABLE, run_engine, spec, tokens
from serve import ServeProcess

STAGED = {"staging": "always", "staging_bytes": "64KiB"}
"""Two of the tiny model's 32 KiB blocks a chunk."""


def _connector(server: ServeProcess, **more: Any) -> dict[str, Any]:
    return {"server": server.address, **STAGED, **more}


def test_staged_pages_equal_outputs_and_a_fresh_instance_loads_them(
    model: str, baseline: list[list[int]]
) -> None:
    server = ServeProcess("--host-capacity", "64MiB")
    try:
        first = run_engine(spec(model, _connector(server)))
        assert tokens(first) == baseline and first["stats"]["tokens_saved"] > 0
        assert first["stats"]["bytes_staged"] >= first["stats"]["bytes_saved"] > 0
        second = run_engine(spec(model, _connector(server)))
        assert tokens(second) == baseline
        assert second["stats"]["tokens_loaded"] == LOADABLE
        assert second["stats"]["bytes_staged"] >= second["stats"]["bytes_loaded"] > 0
    finally:
        server.kill()


def test_staged_pages_and_a_server_killed_mid_run_cost_recomputation_only(
    model: str, baseline: list[list[int]]
) -> None:
    server = ServeProcess("--host-capacity", "64MiB")
    try:
        run = spec(model, _connector(server, timeout=5), rounds=3)
        run.update(kill_after_round=0, kill_pid=server.proc.pid)
        result = run_engine(run, timeout=240)
    finally:
        server.kill()
    for round_ in range(3):
        assert tokens(result, round_) == baseline
    assert "computing instead" in result["log"]
