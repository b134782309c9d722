"""On a real vLLM (run with the vLLM venv: ``.venv-vllm/bin/python -m pytest
benches/bench_vllm.py -s``; skipped elsewhere):

- time to first token of a 480-token prompt whose first 448 tokens kvbridge loads from a
  server, against computing all of it (a new prompt of the same length, same engine);
- the connector's own cost on a decode step with nothing to load or save (every hook vLLM
  calls in a step, run on the live connector), against the engine's decode step.

The model is random, 8 layers of 2048 (its prefill of 480 tokens takes seconds here).
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM: run it with .venv-vllm (tests/with_vllm/run)")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the connector objects live here
ROOT = Path(__file__).parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "with_vllm")]

from serve import ServeProcess  # noqa: E402
from tiny import make_model  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group  # noqa: E402

PROMPT = 480


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = make_model(tmp_path_factory.mktemp("big"), layers=8, hidden=2048)
    server = ServeProcess("--host-capacity", "256MiB", "--handoff-ttl", "0")
    transfer = KVTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_connector_module_path="kvbridge.bindings.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"server": server.address},
    )
    engine = LLM(
        model=str(model),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        max_num_batched_tokens=512,
        block_size=32,
        seed=0,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
        kv_transfer_config=transfer,
    )
    yield engine
    server.kill()


def _prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 999) for _ in range(PROMPT)]


def test_time_to_first_token_loaded_vs_computed(compare: Callable[..., Any], llm: Any) -> None:
    one = SamplingParams(max_tokens=1, temperature=0, detokenize=False)
    cached = _prompt(0)
    llm.generate([{"prompt_token_ids": cached}], one, use_tqdm=False)  # saved by kvbridge
    seeds = iter(range(1, 1 << 20))
    result = compare(
        f"TTFT, {PROMPT}-token prompt, 448 tokens loaded",
        lambda: llm.generate([{"prompt_token_ids": cached}], one, use_tqdm=False),
        lambda: llm.generate([{"prompt_token_ids": _prompt(next(seeds))}], one, use_tqdm=False),
        baseline_name="the same engine computing a new prompt",
        rounds=10,
    )
    stats = get_kv_transfer_group().stats
    print(
        f"loaded {stats['tokens_loaded']} tokens, {stats['bytes_loaded'] / 1e6:.0f} MB "
        f"in {stats['load_seconds']:.2f} s; ratio {result.ratio:.2f}"
    )
    assert stats["tokens_loaded"] >= 10 * 448  # every subject round loaded its prefix


def test_idle_step_cost(compare: Callable[..., Any], llm: Any) -> None:
    """Every connector hook of one decode step with nothing to move, against one step."""
    worker = get_kv_transfer_group()
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(8)]
    from kvbridge.bindings.vllm._meta import StepMeta  # noqa: PLC0415

    empty = StepMeta()

    cached = SimpleNamespace(
        req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
    )
    idle = SimpleNamespace(  # a decode step's scheduler output with nothing new
        preempted_req_ids=set(),
        scheduled_new_reqs=[],
        num_scheduled_tokens={},
        scheduled_cached_reqs=cached,
    )

    def hooks() -> None:
        for _ in range(100):
            meta = scheduler.build_connector_meta(idle)
            worker.handle_preemptions(empty)
            worker.bind_connector_metadata(meta)
            worker.start_load_kv(None)
            for layer in layers:
                worker.wait_for_layer_load(layer)
                worker.save_kv_layer(layer, None, None)
            worker.wait_for_save()
            worker.get_finished(set())
            worker.get_block_ids_with_load_errors()
            worker.build_connector_worker_meta()
            worker.clear_connector_metadata()

    decode = SamplingParams(max_tokens=65, min_tokens=65, temperature=0, detokenize=False)
    short = {"prompt_token_ids": _prompt(99)[:32]}
    llm.generate([short], SamplingParams(max_tokens=1), use_tqdm=False)

    def steps() -> None:  # 64 decode steps (after the first token) of one request
        llm.generate([short], decode, use_tqdm=False)

    result = compare(
        "connector hooks x 6400 idle steps vs 64 decode steps",
        hooks,
        steps,
        baseline_name="vLLM decoding 64 tokens",
        rounds=5,
    )
    per_hook_us = result.subject_s / 100 * 1e6
    per_step_us = result.baseline_s / 64 * 1e6
    print(
        f"connector per idle step: {per_hook_us:.1f} us; decode step: {per_step_us:.0f} us "
        f"({per_hook_us / per_step_us:.2%})"
    )
