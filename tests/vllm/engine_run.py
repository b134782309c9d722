"""Run one vLLM engine (in this process) over token-id prompts and print what it did as
one JSON line: ``python engine_run.py SPEC_JSON``. The tests start it as a subprocess, so
that every engine is a fresh process (as a restarted or second instance is).

SPEC: model, prompts (lists of token ids), rounds, max_tokens, batched (max_num_batched_tokens),
prefix_caching, blocks (num_gpu_blocks_override), connector (extra config, or null for
none), role, failure_policy, abort (request index to abort after the first step).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def _engine(spec: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if spec.get("connector") is not None:
        transfer = KVTransferConfig(
            kv_connector="KVBridgeConnector",
            kv_connector_module_path="kvbridge.bindings.vllm",
            kv_role=spec.get("role", "kv_both"),
            kv_connector_extra_config=spec["connector"],
            kv_load_failure_policy=spec.get("failure_policy", "recompute"),
        )
    return LLM(
        model=spec["model"],
        dtype="float32",
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
    )


def _stats() -> dict[str, Any]:
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    return dict(get_kv_transfer_group().stats) if has_kv_transfer_group() else {}


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import SamplingParams

    llm = _engine(spec)
    params = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0, detokenize=False)
    rounds = []
    for _ in range(spec.get("rounds", 1)):
        outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
        rounds.append(
            [{"tokens": list(o.outputs[0].token_ids), "finish": o.outputs[0].finish_reason} for o in outs]
        )
    print("RESULT " + json.dumps({"rounds": rounds, "stats": _stats()}), flush=True)


if __name__ == "__main__":
    main()
