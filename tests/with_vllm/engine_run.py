"""Run one vLLM engine (in this process) over token-id prompts and print what it did as
one JSON line: ``python engine_run.py SPEC`` (SPEC: JSON, or the path of a file holding it,
as ``harness.run_engine`` passes it: prompts may be past an argument's 128 KiB; a process
vLLM spawns reads the same file). The tests start it as a subprocess, so that every engine
is a fresh process (as a restarted or second instance is).

SPEC: model, dtype (float32 unless named), prompts (lists of token ids), ready (seconds to
wait, before the first round, for the scheduler's connector to reach its server and hold
its keys in step; the result's ``ready`` says whether it did), rounds, max_tokens, batched
(max_num_batched_tokens), prefix_caching, blocks (num_gpu_blocks_override), kv_events
(vLLM's ``KVEventsConfig`` fields: its own KV events published), connector
(extra config, or null for none), role, failure_policy, abort (abort every request once a
load ran), engine (more arguments of ``LLM``: ``hf_overrides``, ``served_model_name``,
...), kill_after_round and kill_pid (SIGKILL a process between two rounds), kill_in_round
and kill_in_pid (SIGKILL it after that round's first two engine steps, its requests under
way), signals (``[round, pid, "SIGSTOP"]``: send after that round). The result has each
round's outputs, its wall seconds (``seconds``), the seconds ``LLM(...)`` took
(``startup``), the KV cache vLLM made (``kv_cache``: its groups' spec kinds and its blocks,
in-process only), the connector's counters (``stats``: the worker's; ``scheduler``: the
scheduler's, in-process only). The log (stderr) holds the connector's start line, which
names its namespace.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
# The engine in this process (its worker's counters are readable), unless the spec asks for
# vLLM's default: scheduler and worker in processes of their own.
_GIVEN = sys.argv[1] if len(sys.argv) > 1 else "{}"
_SPEC = json.loads(_GIVEN if _GIVEN.startswith("{") else Path(_GIVEN).read_text())
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if _SPEC.get("multiprocessing") else "0"
# The connector's start line (its namespace, as an operator reads it) in the result's log.
_bindings = logging.getLogger("kvbridge.bindings")
_bindings.setLevel(logging.INFO)
_bindings.addHandler(logging.StreamHandler(sys.stderr))

from vllm import LLM, SamplingParams  # noqa: E402  (after the environment vLLM reads)
from vllm.config import (  # noqa: E402  (after the environment vLLM reads)
    KVEventsConfig,
    KVTransferConfig,
)
from vllm.distributed.kv_transfer.kv_transfer_state import (  # noqa: E402
    get_kv_transfer_group,
    has_kv_transfer_group,
)

from kvbridge.store import StoreClient  # noqa: E402  (after the environment vLLM reads)


def _engine(spec: dict[str, Any]) -> Any:
    transfer = None
    if spec.get("connector") is not None:
        faulty = spec.get("faulty_loads", False)
        transfer = KVTransferConfig(
            kv_connector="FaultyConnector" if faulty else "KVBridgeConnector",
            kv_connector_module_path="faulty" if faulty else "kvbridge.bindings.vllm",
            kv_role=spec.get("role", "kv_both"),
            kv_connector_extra_config=spec["connector"],
            kv_load_failure_policy=spec.get("failure_policy", "recompute"),
        )
    return LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "float32"),
        enforce_eager=True,
        max_model_len=512,
        max_num_seqs=spec.get("seqs", 8),
        max_num_batched_tokens=spec.get("batched", 64),
        block_size=32,
        seed=0,
        skip_tokenizer_init=True,
        enable_prefix_caching=spec.get("prefix_caching", False),
        num_gpu_blocks_override=spec.get("blocks"),
        kv_transfer_config=transfer,
        kv_events_config=KVEventsConfig(**spec["kv_events"]) if spec.get("kv_events") else None,
        **spec.get("engine", {}),
    )


def _stats() -> dict[str, Any]:
    return dict(get_kv_transfer_group().stats) if has_kv_transfer_group() else {}


def _scheduler_connector(llm: Any) -> Any:
    """The scheduler side's connector, where the engine runs in this process (or None)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    return getattr(getattr(core, "scheduler", None), "connector", None)


def _kv_cache(llm: Any) -> dict[str, Any]:
    """The KV cache vLLM made (in-process only): its groups' spec kinds and its blocks."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    config = getattr(getattr(core, "scheduler", None), "kv_cache_config", None)
    if config is None:
        return {}
    groups = [type(group.kv_cache_spec).__name__ for group in config.kv_cache_groups]
    return {"groups": groups, "blocks": int(config.num_blocks)}


def _scheduler_stats(llm: Any) -> dict[str, Any]:
    """The scheduler side's counters (lookups), where the engine runs in this process."""
    connector = _scheduler_connector(llm)
    return dict(connector.stats) if connector is not None else {}


def main() -> None:
    spec = _SPEC
    started = time.monotonic()
    llm = _engine(spec)
    startup = time.monotonic() - started
    ready = None
    if spec.get("ready") is not None:  # the scheduler's mirror in step before the first prompt
        ready = _scheduler_connector(llm).wait_ready(spec["ready"])
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0, detokenize=False)
    rounds: list[list[dict[str, Any]]] = []
    seconds: list[float] = []
    for number in range(spec.get("rounds", 1)):
        started = time.monotonic()
        if spec.get("abort"):
            _abort_after_first_steps(llm, spec["prompts"], params)
            rounds.append([])
            continue
        if spec.get("kill_in_round") == number:
            outs = _kill_after_first_steps(llm, spec["prompts"], params, spec["kill_in_pid"])
        else:
            inputs = [{"prompt_token_ids": p} for p in spec["prompts"]]
            outs = llm.generate(inputs, params, use_tqdm=False)
        rounds.append([_output(o) for o in outs])
        seconds.append(time.monotonic() - started)
        if spec.get("kill_after_round") == number:
            os.kill(spec["kill_pid"], signal.SIGKILL)  # the server dies between two rounds
        for after, pid, name in spec.get("signals", []):
            if after == number:
                os.kill(pid, getattr(signal, name))
    result: dict[str, Any] = {
        "rounds": rounds,
        "seconds": seconds,
        "startup": startup,
        "ready": ready,
        "kv_cache": _kv_cache(llm),
        "stats": _stats(),
        "scheduler": _scheduler_stats(llm),
    }
    if spec.get("observe"):  # what the server holds while this engine still runs
        result["server"] = _server_figures(spec["observe"])
    print("RESULT " + json.dumps(result), flush=True)


def _server_figures(address: str) -> dict[str, Any]:
    time.sleep(1.0)  # the engine's last releases are one-way casts: let them land
    with StoreClient(address, block_bytes=4096, namespace="observer") as client:
        stats = client.server_stats()
    return {"open_leases": stats["server"]["open_leases"]}


def _output(out: Any) -> dict[str, Any]:
    first = out.outputs[0]
    cached = out.num_cached_tokens or 0  # vLLM's own prefix cache + what the connector loaded
    return {"tokens": list(first.token_ids), "finish": first.finish_reason, "cached": cached}


def _kill_after_first_steps(llm: Any, prompts: list[list[int]], params: Any, pid: int) -> list[Any]:
    """Add every prompt, run two engine steps, SIGKILL ``pid`` (a cache server), and step
    until every request finished; their outputs, in prompt order."""
    engine = llm.llm_engine
    ids = [f"kill-{i}" for i in range(len(prompts))]
    for req_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(req_id, {"prompt_token_ids": prompt}, params)
    done: dict[str, Any] = {}
    for step in range(10_000):
        if step == 2:
            os.kill(pid, signal.SIGKILL)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if len(done) == len(ids):
            break
    return [done[req_id] for req_id in ids]


def _abort_after_first_steps(llm: Any, prompts: list[list[int]], params: Any) -> None:
    """Add every prompt, step until the connector loaded something (lookups are answered
    on a later step, on the connector's threads; at most 30 s), abort them all, and step
    until idle."""
    engine = llm.llm_engine
    ids = [f"abort-{i}" for i in range(len(prompts))]
    for req_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(req_id, {"prompt_token_ids": prompt}, params)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not _stats().get("tokens_loaded"):
        engine.step()
    engine.abort_request(ids)
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        engine.step()


if __name__ == "__main__":
    main()
