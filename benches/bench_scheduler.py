"""What the vLLM connector costs vLLM's scheduler per new request (run with the vLLM venv:
``.venv-vllm/bin/python -m pytest benches/bench_scheduler.py -s``; skipped elsewhere).

The time ``get_num_new_matched_tokens`` takes, summed over every call vLLM makes for one
request until it gets a count (it asks again each step; a step here is 0.5 ms, an idle
vLLM loop's pace), p50 and p99 over 400 requests, hits and misses apart, against today's
blocking path in the same run: the lookup and the pin made in that call
(``ConnectorCore.lookup`` + ``pin``, what the scheduler side did before). Three ways:
asking the server on the connector's thread; the mirror of a server that publishes its
event stream (a miss answered locally, a hit only pinned); and the blocking path. A real
``kvbridge serve`` on loopback.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from conftest import _EXTRA_LINES

pytest.importorskip("vllm", reason="needs vLLM: run it with .venv-vllm (tests/with_vllm/run)")
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from serve import ServeProcess

from kvbridge.bindings import ConnectorConfig, ConnectorCore, Identity
from kvbridge.bindings.vllm._groups import Group, KVGroups
from kvbridge.bindings.vllm._scheduler import LOOKUP_THREADS, SchedulerSide
from kvbridge.store import StoreClient

BLOCK_TOKENS, BLOCK_BYTES, PROMPT = 32, 32 << 10, 512
REQUESTS = 400
STEP_S = 0.0005

ONE_GROUP = KVGroups((Group(0, "full", 0, ("layer",)),))
"""A model of one full-attention KV cache group."""


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    proc = ServeProcess(
        *("--host-capacity", "512MiB", "--handoff-ttl", "0", "--events-port", "0"),
        *("--max-namespaces", "1"),
    )
    yield proc
    proc.kill()


def _identity() -> Identity:
    return Identity("bench", "m", "float32", "cpu", BLOCK_TOKENS, BLOCK_BYTES, "tp0/1", "")


def _core(server: ServeProcess, *, mirror: bool) -> ConnectorCore:
    config = ConnectorConfig(server=server.address, mirror=mirror)
    core = ConnectorCore(config, _identity(), mirror=True, connections=LOOKUP_THREADS)
    core.lookup(core.keys(list(range(BLOCK_TOKENS))))  # connected
    return core


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 30_000) for _ in range(PROMPT)] for _ in range(REQUESTS)]


def _store(server: ServeProcess, core: ConnectorCore, prompts: list[list[int]]) -> None:
    block = np.zeros(BLOCK_BYTES, np.uint8)
    with StoreClient(server.address, block_bytes=BLOCK_BYTES, namespace=core.namespace) as c:
        for tokens in prompts:
            ks = core.keys(tokens)
            c.put(ks, [block] * len(ks))


def _request(req_id: str, tokens: list[int]) -> Any:
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=tokens,
        num_tokens=len(tokens),
        mm_features=[],
        kv_transfer_params=None,
        prompt_embeds=None,
        lora_request=None,
        cache_salt=None,
    )


def _scheduler_cost(side: SchedulerSide, prompts: list[list[int]], tag: str) -> np.ndarray:
    """Seconds inside ``matched`` per request, summed over its calls."""
    costs = []
    for i, tokens in enumerate(prompts):
        request = _request(f"{tag}-{i}", tokens)
        spent = 0.0
        while True:
            started = time.perf_counter()
            answer, _ = side.matched(request, 0)
            spent += time.perf_counter() - started
            if answer is not None:
                break
            time.sleep(STEP_S)  # vLLM's next step
        side.finished(request)  # releases the pin
        costs.append(spent)
    return np.array(costs)


def _blocking_cost(core: ConnectorCore, prompts: list[list[int]]) -> np.ndarray:
    """Today's path: the lookup and the pin inside the call."""
    costs = []
    for tokens in prompts:
        keys = core.keys(tokens)[: (len(tokens) - 1) // BLOCK_TOKENS]
        started = time.perf_counter()
        hit = core.lookup(keys)
        hold = core.pin(keys[:hit]) if hit else None
        costs.append(time.perf_counter() - started)
        core.unpin(hold)
    return np.array(costs)


def _line(name: str, costs: np.ndarray) -> str:
    us = costs * 1e6
    return f"{name:<44} p50 {np.percentile(us, 50):8.1f} us  p99 {np.percentile(us, 99):8.1f} us"


@pytest.mark.parametrize("kind", ["hits", "misses"])
def test_scheduler_cost_per_new_request(server: ServeProcess, kind: str) -> None:
    lines = []
    for mode in ("connector thread", "mirror"):
        core = _core(server, mirror=mode == "mirror")
        side = SchedulerSide(core, ONE_GROUP, loads=True, saves=False)
        try:
            prompts = _prompts(hash((kind, mode)) & 0xFFFF)
            if kind == "hits":
                _store(server, core, prompts)
            if mode == "mirror":
                _wait_mirror(core)
                _wait_mirrored(core, prompts if kind == "hits" else [])
            cost = _scheduler_cost(side, prompts, f"{kind}-{mode}")
            blocking = _blocking_cost(core, prompts)
        finally:
            side.close()
            core.close()
        lines.append(_line(f"{kind}: matched() via the {mode}", cost))
        lines.append(_line(f"{kind}: blocking lookup + pin (same run)", blocking))
    for line in lines:
        _EXTRA_LINES.append(line)
        print(line)


def _wait_mirror(core: ConnectorCore) -> None:
    deadline = time.monotonic() + 30
    while core.mirrored([]) is None:
        assert time.monotonic() < deadline, "the mirror never got in step"
        time.sleep(0.01)


def _wait_mirrored(core: ConnectorCore, prompts: list[list[int]]) -> None:
    for tokens in prompts:
        keys = core.keys(tokens)
        deadline = time.monotonic() + 30
        while core.mirrored(keys) != len(keys):
            assert time.monotonic() < deadline, "the mirror never saw the puts"
            time.sleep(0.001)


SHORT, COUNT, ROUNDS = 96, 256, 4


def test_requests_per_second_with_the_connector(server: ServeProcess, tmp_path: Path) -> None:
    """Requests per second an engine runs on short prompts (96 tokens, one output token,
    nothing cached: every lookup misses) with a loading connector (``kv_consumer``), the
    mirror's way and the lookup thread's, against the same engine without a connector:
    the connector's overhead on vLLM's scheduling. Each engine is a fresh process; the
    median of its rounds after the first."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "with_vllm"))
    from harness import run_engine  # noqa: PLC0415  (the vLLM tests' engine runner)
    from tiny import make_model  # noqa: PLC0415

    model = str(make_model(tmp_path / "model"))
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 999) for _ in range(SHORT)] for _ in range(COUNT)]
    plain = ServeProcess("--host-capacity", "256MiB")  # publishes no events
    try:
        runs = {
            "no connector": None,
            "connector, mirror": {"server": server.address},
            "connector, lookup thread": {"server": plain.address},
        }
        seconds = {}
        for name, connector in runs.items():
            spec: dict[str, Any] = {"model": model, "prompts": prompts, "connector": connector}
            spec.update(rounds=ROUNDS, max_tokens=1, role="kv_consumer", seqs=64, batched=2048)
            result = run_engine(spec, timeout=900)
            seconds[name] = float(np.median(result["seconds"][1:]))
    finally:
        plain.kill()
    base = seconds["no connector"]
    for name, took in seconds.items():
        line = f"{name:<28} {COUNT / took:8.1f} requests/s  ({took / base:5.3f}x the time)"
        _EXTRA_LINES.append(line)
        print(line)
