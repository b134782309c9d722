"""A hybrid model through the vLLM connector (issue 33), on a real vLLM (run with the vLLM
venv: ``.venv-vllm/bin/python -m pytest benches/bench_vllm_hybrid.py -s``; skipped
elsewhere). The model is ``tiny.py``'s random Gemma-3 shape: 4 layers, a sliding window of
64 tokens on layers 0 and 2, full attention on 1 and 3; 32-token blocks.

Three configurations, same run, each engine a fresh process (``engine_run.py``):

(a) vLLM without a connector: the baseline;
(b) the kvbridge connector as it is, vLLM's hybrid KV cache manager (HMA) kept on;
(c) the connector with HMA off (``disable_hybrid_kv_cache_manager=True``), as vLLM ran it
    before the connector declared ``SupportsHMA``: every layer is a full-attention layer
    to the cache, one KV cache group.

Measured:

- the KV cache vLLM makes at start (its groups, its blocks, the tokens of KV it says it
  can hold and its concurrency at 512 tokens), (b) and (c) against (a);
- the KV bytes moved per hit: for (b) and (c), each with a fresh ``kvbridge serve``, a
  first engine saves the prompts and a fresh engine loads them; the loading engine's
  worker counters give bytes per request that hit and per token, (b) against (c);
- the loading engine's round wall seconds (median of its rounds) against (a) computing the
  same prompts.

Every run's outputs must equal (a)'s: a sanity check, not a timed figure. pytest-benchmark
times (b)'s loading engine as a whole process (its start included); the table's seconds
are the engine's rounds alone.
"""

from __future__ import annotations

import os
import random
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: run it with .venv-vllm (tests/with_vllm/run)")
pytest.importorskip("pytest_benchmark", reason="needs pytest-benchmark in this venv")
ROOT = Path(__file__).parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "with_vllm")]

from harness import run_engine, spec, tokens  # noqa: E402
from serve import ServeProcess  # noqa: E402
from tiny import make_gemma3  # noqa: E402

WINDOW = 64
ROUNDS = 5
"""Rounds of (a) and of each loading engine (prefix caching is off: every round of a
loading engine loads again); the table gives the median round."""

HMA_OFF = {"disable_hybrid_kv_cache_manager": True}
LOG_TO_STDERR = {"VLLM_LOGGING_STREAM": "ext://sys.stderr"}
"""vLLM logs to standard output; ``run_engine`` keeps standard error as ``result["log"]``,
where the capacity vLLM states at start is read."""

CAPACITY = re.compile(
    r"KV cache size: ([\d,]+) tokens, Maximum concurrency for [\d,]+ tokens per request: "
    r"([\d.]+)x"
)


def _prompts(seed: int = 33) -> list[list[int]]:
    """Six prompts of 320-480 tokens, several windows long: a 480-token base, prefixes of
    it ending on a block boundary (256, 416) and inside a block (300), one sharing nothing
    with it and one sharing its first 256 tokens with that one."""
    rng = random.Random(seed)
    base = [rng.randrange(1, 999) for _ in range(480)]
    other = [rng.randrange(1, 999) for _ in range(400)]
    return [
        base,
        base[:256] + other[:64],
        base[:300] + [7] * 60,
        base[:416],
        other,
        other[:256] + base[:200],
    ]


PROMPTS = _prompts()


@dataclass(frozen=True)
class _Pair:
    """A configuration's two engines on one fresh server: the first saves, the next loads."""

    saved: dict[str, Any]
    loaded: dict[str, Any]


@dataclass(frozen=True)
class _Row:
    """One figure beside its baseline from the same run; ratio = figure / baseline."""

    name: str
    figure: float
    baseline: float
    baseline_name: str

    @property
    def ratio(self) -> float:
        return self.figure / self.baseline if self.baseline else float("nan")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_gemma3(tmp_path_factory.mktemp("gemma3"), window=WINDOW))


def _run(model: str, connector: dict[str, Any] | None, **more: Any) -> dict[str, Any]:
    """One fresh engine over :data:`PROMPTS` (8 tokens each, greedy)."""
    spec_ = spec(model, connector, prompts=PROMPTS, **{"rounds": ROUNDS, **more})
    result = run_engine(spec_, timeout=600, env=LOG_TO_STDERR)
    result["load_average"] = os.getloadavg()[0]  # the machine is shared: other engines
    return result


def _through_server(model: str, engine: dict[str, Any], benchmark: Any = None) -> _Pair:
    """Save :data:`PROMPTS` through a fresh server, then load them in a fresh engine (timed
    by ``benchmark`` where given). ``engine``: more arguments of ``LLM``."""
    server = ServeProcess("--host-capacity", "256MiB", "--events-port", "0")
    try:
        connector = {"server": server.address}
        saved = _run(model, connector, rounds=1, engine=engine)

        def load() -> dict[str, Any]:
            return _run(model, connector, ready=60, engine=engine)

        loaded = load() if benchmark is None else benchmark.pedantic(load, rounds=1, iterations=1)
    finally:
        server.kill()
    assert loaded["ready"] is True, "the loading engine's scheduler never reached its server"
    return _Pair(saved, loaded)


def _assert_outputs_equal(run: dict[str, Any], alone: dict[str, Any]) -> None:
    for number in range(len(run["rounds"])):
        assert tokens(run, number) == tokens(alone), f"round {number}'s outputs differ"


def _capacity(run: dict[str, Any]) -> tuple[int, float]:
    """The KV tokens vLLM says it can hold, and its concurrency at 512-token requests."""
    found = CAPACITY.search(run["log"])
    assert found is not None, "vLLM's KV cache size line is missing from the log"
    return int(found[1].replace(",", "")), float(found[2])


def _start_rows(alone: dict[str, Any], on: dict[str, Any], off: dict[str, Any]) -> list[_Row]:
    """(b) and (c)'s KV cache at start against (a)'s."""
    base = "(a) no connector"
    rows = []
    for label, run in (("(b) HMA on", on), ("(c) HMA off", off)):
        (size, concurrency), (size_a, concurrency_a) = _capacity(run), _capacity(alone)
        blocks, blocks_a = run["kv_cache"]["blocks"], alone["kv_cache"]["blocks"]
        rows += [
            _Row(f"{label}: KV cache blocks", blocks, blocks_a, base),
            _Row(f"{label}: KV cache size, tokens (vLLM's)", size, size_a, base),
            _Row(f"{label}: concurrency, 512-token requests", concurrency, concurrency_a, base),
        ]
    return rows


def _hits(run: dict[str, Any]) -> tuple[int, int]:
    """Requests with tokens computed elsewhere (none of vLLM's own: prefix caching is off),
    over every round, and those tokens."""
    cached = [out["cached"] for outs in run["rounds"] for out in outs]
    return sum(1 for count in cached if count > 0), sum(cached)


def _moved(pair: _Pair) -> dict[str, float]:
    """A configuration's figures per hit, from its loading engine's worker counters."""
    stats = pair.loaded["stats"]
    hits, hit_tokens = _hits(pair.loaded)
    return {
        "requests that hit": hits,
        "tokens hit (prompt tokens not computed)": hit_tokens,
        "tokens_loaded (summed over groups)": stats["tokens_loaded"],
        "bytes_loaded": stats["bytes_loaded"],
        "bytes per hit": stats["bytes_loaded"] / hits,
        "bytes per token hit": stats["bytes_loaded"] / hit_tokens,
        "bytes per loaded token": stats["bytes_loaded"] / stats["tokens_loaded"],
        "bytes saved by the first engine": pair.saved["stats"]["bytes_saved"],
    }


def _hit_rows(on: _Pair, off: _Pair) -> list[_Row]:
    """(b)'s bytes moved against (c)'s."""
    figures, baselines = _moved(on), _moved(off)
    return [
        _Row(f"(b) HMA on: {name}", figures[name], baselines[name], "(c) HMA off")
        for name in figures
    ]


def _round_seconds(run: dict[str, Any]) -> float:
    return float(statistics.median(run["seconds"]))


def _time_rows(alone: dict[str, Any], on: _Pair, off: _Pair) -> list[_Row]:
    """The loading engines' rounds against (a) computing every token of the same prompts."""
    base = "(a) computing them"
    return [
        _Row(f"{label}: loading round, s", _round_seconds(pair.loaded), _round_seconds(alone), base)
        for label, pair in (("(b) HMA on", on), ("(c) HMA off", off))
    ]


def _report(
    benchmark: Any, rows: list[_Row], groups: dict[str, list[str]], loads: dict[str, float]
) -> None:
    benchmark.extra_info["kv_cache_groups"] = groups
    benchmark.extra_info["load_average_after"] = loads
    benchmark.extra_info["prompt_tokens"] = [len(prompt) for prompt in PROMPTS]
    for row in rows:
        benchmark.extra_info[row.name] = {
            "figure": row.figure,
            "baseline": row.baseline,
            "baseline_name": row.baseline_name,
            "ratio": row.ratio,
        }
    print(f"\nprompts of {[len(p) for p in PROMPTS]} tokens, {ROUNDS} rounds; groups: {groups}")
    print(f"1-minute load average after each engine (2 cores): {loads}")
    print(f"{'figure':<62} {'value':>12} {'baseline':>12}  {'':<18} ratio")
    for row in rows:
        print(
            f"{row.name:<62} {_fmt(row.figure):>12} {_fmt(row.baseline):>12}  "
            f"{row.baseline_name:<18} {row.ratio:.3f}"
        )


def _fmt(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3f}"


def test_hybrid_kv_cache_and_bytes_per_hit(benchmark: Any, gemma: str) -> None:
    """(a), (c), then (b) (timed): one engine at a time."""
    alone = _run(gemma, None)
    off = _through_server(gemma, HMA_OFF)
    on = _through_server(gemma, {}, benchmark)
    for run in (on.saved, on.loaded, off.saved, off.loaded):
        _assert_outputs_equal(run, alone)
    groups = {
        "(a) no connector": alone["kv_cache"]["groups"],
        "(b) HMA on": on.loaded["kv_cache"]["groups"],
        "(c) HMA off": off.loaded["kv_cache"]["groups"],
    }
    rows = (
        _start_rows(alone, on.loaded, off.loaded) + _hit_rows(on, off) + _time_rows(alone, on, off)
    )
    engines = {"(a)": alone, "(c) saving": off.saved, "(c) loading": off.loaded}
    engines |= {"(b) saving": on.saved, "(b) loading": on.loaded}
    loads = {name: round(run["load_average"], 2) for name, run in engines.items()}
    _report(benchmark, rows, groups, loads)
