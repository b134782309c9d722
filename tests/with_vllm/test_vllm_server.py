"""The connector against a ``kvbridge serve`` on a real vLLM: a second, fresh instance
loads the prefix the first saved (also after the server restarted on its disk), a server
killed mid-run costs recomputation only, a frozen one never holds the scheduler, and
aborted requests leave nothing held."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from harness import (
    BLOCK,
    LOADABLE,
    PATHS,
    PROMPTS,
    namespace_of,
    prompts,
    run_engine,
    spec,
    tokens,
)
from serve import ServeProcess

from kvbridge.store import Lineage, StoreClient
from kvbridge.transfer import nixl_available


def _namespaces(server: ServeProcess) -> list[dict[str, Any]]:
    """Every namespace's figures, as any client of the server sees them."""
    with StoreClient(server.address, block_bytes=4096, namespace="observer") as client:
        stats = client.server_stats()
    return [ns for ns in stats["namespaces"] if ns["hits"] or ns["tiers"][0]["blocks"]]


def _saved_lineage(server: ServeProcess, log: str) -> dict[bytes, Lineage | None]:
    """The connector's namespace (named in its log) as the server keeps it: each key with
    what it was hashed from."""
    name, block_bytes = namespace_of(log)
    with StoreClient(server.address, block_bytes=block_bytes, namespace=name) as client:
        snapshot = client.snapshot(lineage=True)
    assert snapshot.lineage is not None
    return dict(zip(snapshot.keys, snapshot.lineage, strict=True))


def test_a_fresh_instance_loads_what_another_saved(model: str, baseline: list[list[int]]) -> None:
    """Through a server that publishes its event stream: the second instance's scheduler
    answers from its mirror of the namespace's keys (and pins what it hits). It asks once
    its mirror is in step (``ready``): a prompt looked up before then asks the server
    instead, which loads as much but is not what this test counts. The first instance's
    saves carry their token ids: the server keeps each block's, chained to its parent."""
    server = ServeProcess("--host-capacity", "64MiB", "--events-port", "0")
    try:
        connector = {"server": server.address}
        first = run_engine(spec(model, connector))
        assert tokens(first) == baseline and first["stats"]["tokens_saved"] > 0
        kept = _saved_lineage(server, first["log"])
        chains = {
            tuple(prompt[: (i + 1) * BLOCK])
            for prompt in PROMPTS
            for i in range(len(prompt) // BLOCK)
        }
        assert len(kept) == len(chains)  # one block per distinct prefix, none without tokens
        for lineage in kept.values():
            assert lineage is not None
            prefix: list[int] = []
            step: Lineage | None = lineage
            while step is not None:  # up the chain: the whole prefix is kept, in order
                prefix[:0] = step.token_ids
                step = None if step.parent is None else kept[step.parent]
            assert tuple(prefix) in chains
        second = run_engine(spec(model, connector, ready=60))
        assert second["ready"] is True
        assert tokens(second) == baseline
        assert second["stats"]["tokens_loaded"] == LOADABLE
        assert second["scheduler"]["lookups_local"] > 0
        (ns,) = [n for n in _namespaces(server) if n["hits"]]
        assert ns["hits"] * 32 >= LOADABLE  # the server counts the same blocks
    finally:
        server.kill()


def test_the_cache_survives_a_server_restart_on_disk(
    model: str, baseline: list[list[int]], tmp_path: Path
) -> None:
    disk = ("--host-capacity", "16MiB", "--disk-path", str(tmp_path), "--disk-capacity", "64MiB")
    server = ServeProcess(*disk)
    try:
        first = run_engine(spec(model, {"server": server.address}))
        assert tokens(first) == baseline
    finally:
        server.stop(signal.SIGTERM)  # a clean stop spills memory to disk
    server = ServeProcess(*disk)
    try:
        second = run_engine(spec(model, {"server": server.address}))
        assert tokens(second) == baseline
        assert second["stats"]["tokens_loaded"] == LOADABLE
    finally:
        server.kill()


KILLED: dict[str, tuple[dict[str, Any], str]] = {
    **{path: (PATHS[path], "tcp") for path in PATHS},
    "nixl": ({**PATHS["direct"], "transports": "nixl"}, "nixl"),
}
"""How pages move, and the server's transport, for the killed-server case."""


@pytest.mark.parametrize("path", list(KILLED))
def test_a_server_killed_mid_run_costs_recomputation_only(
    model: str, baseline: list[list[int]], path: str
) -> None:
    extra, transport = KILLED[path]
    if transport == "nixl" and not nixl_available():
        pytest.skip("NIXL is not installed here (tests/with_vllm/run installs it)")
    server = ServeProcess("--host-capacity", "64MiB", "--transports", transport)
    try:
        run = spec(model, {"server": server.address, "timeout": 5, **extra}, rounds=3)
        run.update(kill_after_round=0, kill_pid=server.proc.pid)
        result = run_engine(run, timeout=240)
    finally:
        server.kill()
    for round_ in range(3):
        assert tokens(result, round_) == baseline
    assert "computing instead" in result["log"]  # one warning per pause, not per call
    assert "kvbridge lookup failed" in result["log"] or "kvbridge save failed" in result["log"]


def test_a_frozen_server_never_holds_the_engine(model: str, baseline_run: dict[str, Any]) -> None:
    """The server is frozen (SIGSTOP) while the engine starts and again for its third
    round: the engine starts without waiting for it, those rounds compute every prompt
    (outputs equal, no request fails) and end long before a store call's timeout (120 s
    here); once the server runs again (SIGCONT) the next round loads. Before lookups left
    the scheduler, the start took two connect timeouts (10 s each) more and the frozen
    round the whole store timeout."""
    server = ServeProcess("--host-capacity", "64MiB")
    pid = server.proc.pid
    try:
        os.kill(pid, signal.SIGSTOP)
        thaw, freeze = [0, pid, "SIGCONT"], [1, pid, "SIGSTOP"]
        connector = {"server": server.address, "timeout": 120, "lookup_wait": 0.05}
        run = spec(model, connector, rounds=4)  # the default lookup_wait
        run["signals"] = [thaw, freeze, [2, pid, "SIGCONT"]]
        result = run_engine(run, timeout=600)
    finally:
        os.kill(pid, signal.SIGCONT)
        server.kill()
    for round_ in range(4):
        assert tokens(result, round_) == tokens(baseline_run)
    assert result["startup"] < baseline_run["startup"] + 8  # not 2 x 10 s of connecting
    assert max(result["seconds"][0], result["seconds"][2]) < 60  # no call waited for 120 s
    assert result["scheduler"]["lookups_late"] > 0  # the frozen rounds' lookups gave up
    assert sum(out["cached"] for out in result["rounds"][3]) > 0  # loads again


def test_aborted_requests_leave_no_lease_or_pin(model: str) -> None:
    server = ServeProcess("--host-capacity", "64MiB")
    try:
        connector = {"server": server.address}
        run_engine(spec(model, connector))  # the prefix is cached: the aborted ones load
        extra = [p + [11] * 40 for p in PROMPTS]  # cached heads, new tails: loads and saves
        aborted = run_engine(
            {**spec(model, connector), "prompts": extra, "abort": True, "observe": server.address}
        )
        assert aborted["stats"]["tokens_loaded"] > 0  # they were mid-flight when aborted
        assert aborted["server"]["open_leases"] == 0  # asked while the engine still runs
    finally:
        server.kill()


@pytest.mark.parametrize("seed", [2])
def test_other_prompts_equal_too(model: str, seed: int) -> None:
    """Prompts of another seed, through a server, against their own baseline."""
    other = prompts(seed)
    server = ServeProcess("--host-capacity", "64MiB")
    try:
        base = tokens(run_engine({"model": model, "prompts": other, "connector": None}))
        for _ in range(2):
            connector = {"server": server.address}
            result = run_engine({"model": model, "prompts": other, "connector": connector})
            assert tokens(result) == base
    finally:
        server.kill()
