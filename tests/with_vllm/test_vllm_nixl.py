"""The connector over the one-sided ``nixl`` transport on a real vLLM, against ``kvbridge
serve --transports nixl``: outputs equal vLLM's without a connector, a fresh instance loads
what another saved, and a server killed mid-run costs recomputation only."""

from __future__ import annotations

import pytest
from harness import LOADABLE, PATHS, run_engine, spec, tokens
from serve import ServeProcess

from kvbridge.transfer._nixl_agent import nixl_available

pytestmark = pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed here (tests/with_vllm/run installs it)"
)

NIXL = {"transports": "nixl"}


def test_a_fresh_instance_loads_what_another_saved_over_nixl(
    model: str, baseline: list[list[int]]
) -> None:
    server = ServeProcess("--host-capacity", "64MiB", "--transports", "nixl")
    try:
        connector = {"server": server.address, **NIXL}
        first = run_engine(spec(model, connector))
        assert tokens(first) == baseline and first["stats"]["tokens_saved"] > 0
        second = run_engine(spec(model, connector))
        assert tokens(second) == baseline
        assert second["stats"]["tokens_loaded"] == LOADABLE
    finally:
        server.kill()


def test_a_server_killed_mid_run_over_nixl_costs_recomputation_only(
    model: str, baseline: list[list[int]]
) -> None:
    server = ServeProcess("--host-capacity", "64MiB", "--transports", "nixl")
    try:
        connector = {"server": server.address, "timeout": 5, **NIXL, **PATHS["direct"]}
        run = spec(model, connector, rounds=3)
        run.update(kill_after_round=0, kill_pid=server.proc.pid)
        result = run_engine(run, timeout=240)
    finally:
        server.kill()
    for round_ in range(3):
        assert tokens(result, round_) == baseline
    assert "computing instead" in result["log"]
