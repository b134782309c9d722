"""The namespace the vLLM connector derives from each of several engine configurations,
without running an engine: ``python identity_run.py SPEC_JSON`` prints one JSON line.

SPEC: base (``EngineArgs`` of the reference engine), variants (a list of changes to it).
Each configuration is resolved by vLLM (``EngineArgs.create_engine_config``: hf_overrides
applied, the dtype and quantization resolved, the hub revision looked up), then a
scheduler-side connector is made over one fixed KV cache config, so that only what the
engine settings say can tell two namespaces apart. The namespace is read where an
operator reads it: the connector's start line in the log.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

# imported after the environment vLLM reads
import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)

from kvbridge.bindings.vllm import KVBridgeConnector


class _Starts(logging.Handler):
    """The connector's start lines: ``kvbridge namespace NAME: ...``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.namespaces: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("kvbridge namespace") and isinstance(record.args, tuple):
            self.namespaces.append(str(record.args[0]))


def _cache_config() -> Any:
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    group = KVCacheGroupSpec(layer_names=["l0", "l1"], kv_cache_spec=spec)
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[group])


def _namespace(args: dict[str, Any], starts: _Starts) -> str:
    transfer = KVTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_connector_module_path="kvbridge.bindings.vllm",
        kv_role="kv_both",
    )
    config = EngineArgs(**args, kv_transfer_config=transfer).create_engine_config()
    connector = KVBridgeConnector(config, KVConnectorRole.SCHEDULER, _cache_config())
    connector.shutdown()
    return starts.namespaces[-1]


def main() -> None:
    spec = json.loads(sys.argv[1])
    starts = _Starts()
    logger = logging.getLogger("kvbridge.bindings")
    logger.addHandler(starts)
    logger.setLevel(logging.INFO)
    base = {"enforce_eager": True, "skip_tokenizer_init": True, **spec["base"]}
    namespaces = [_namespace({**base, **change}, starts) for change in spec["variants"]]
    print("RESULT " + json.dumps({"base": _namespace(base, starts), "variants": namespaces}))


if __name__ == "__main__":
    main()
