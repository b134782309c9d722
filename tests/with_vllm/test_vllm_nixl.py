"""The connector over the one-sided ``nixl`` transport on a real vLLM, against ``kvbridge
serve --transports nixl``: outputs equal vLLM's without a connector, and a fresh instance
loads what another saved (a server killed mid-run over nixl: ``test_vllm_server``; P/D over
nixl: ``test_vllm_pd``)."""

from __future__ import annotations

import pytest
from harness import LOADABLE, run_engine, spec, tokens
from serve import ServeProcess

from kvbridge.transfer import nixl_available

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
