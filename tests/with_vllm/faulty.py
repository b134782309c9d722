"""A KVBridgeConnector whose loads fail, for the failure tests: every load of a key in
the store raises as a broken data path would (the lookup still says the key is there,
as when a block's bytes are lost but its index entry is not; with
``KVB_FAIL_EVERY_OTHER_LOAD=1`` every second load). Loaded by vLLM with
``kv_connector="FaultyConnector"``, ``kv_connector_module_path="faulty"``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvbridge.bindings.vllm import KVBridgeConnector
from kvbridge.store import BlockKey
from kvbridge.transfer import TransferError


class _FailingLoads:
    """Every load fails; with ``every_other``, every second one (of a hybrid model's
    request, one KV cache group's load fails and the other's succeeds)."""

    def __init__(self, backend: Any, *, every_other: bool = False) -> None:
        self._backend = backend
        self._every_other = every_other
        self.loads = 0

    def load(self, keys: Sequence[BlockKey], offsets: np.ndarray, start: int = 0) -> None:
        self.loads += 1
        if self._every_other and self.loads % 2:
            return self._backend.load(keys, offsets, start)  # type: ignore[no-any-return]
        raise TransferError("injected: the data path is down")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


class FaultyConnector(KVBridgeConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if self._worker is not None:  # the worker's loads fail (the scheduler's calls do not)
            self._core._up()  # connected now: the connector dials on a thread of its own
            if self._core._backend is not None:
                every_other = os.environ.get("KVB_FAIL_EVERY_OTHER_LOAD") == "1"
                self._core._backend = _FailingLoads(self._core._backend, every_other=every_other)
