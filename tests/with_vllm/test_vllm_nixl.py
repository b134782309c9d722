"""The connector over the one-sided ``nixl`` transport on a real vLLM, against ``kvbridge
serve --transports nixl``: outputs equal vLLM's without a connector, and a fresh instance
loads what another saved (a server killed mid-run over nixl: ``test_vllm_server``; P/D over
nixl: ``test_vllm_pd``)."""

from __future__ import annotations

import pytest
from harness import LOADABLE, run_engine, spec, tokens
from serve import ServeProcess

from kvbridge.store import StoreClient
from kvbridge.transfer import nixl_available, ucx_available

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


@pytest.mark.skipif(ucx_available(), reason="ucxx is installed here: auto keeps ucx")
def test_auto_takes_nixl_where_ucxx_is_not_installed() -> None:
    """A client's ``transports="auto"`` (the connectors' setting) where NIXL imports and
    ucxx does not (this venv): nixl against a server that offers it, tcp against one that
    does not."""
    nixl_server = ServeProcess("--host-capacity", "16MiB", "--transports", "nixl,tcp")
    tcp_server = ServeProcess("--host-capacity", "16MiB")
    try:
        with (
            StoreClient(nixl_server.address, block_bytes=4096, transports="auto") as fast,
            StoreClient(tcp_server.address, block_bytes=4096, transports="auto") as plain,
        ):
            assert (fast.peer.transport, plain.peer.transport) == ("nixl", "tcp")
    finally:
        nixl_server.kill()
        tcp_server.kill()
