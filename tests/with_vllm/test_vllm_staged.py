"""The staged path on a real vLLM (CPU): ``staging: "always"`` moves every page
through the host staging buffer, as a KV cache in GPU memory goes, here with a buffer of two
blocks (32 KiB each) so that every load and save runs in chunks. Outputs equal an instance
without a connector and a fresh instance loads what another saved. (A server killed mid-run
and P/D run staged too: ``test_vllm_server.py``, ``test_vllm_pd.py``.)"""

from __future__ import annotations

from typing import Any

from harness import LOADABLE, PATHS, run_engine, spec, tokens
from serve import ServeProcess


def _connector(server: ServeProcess) -> dict[str, Any]:
    return {"server": server.address, **PATHS["staged"]}


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
