"""The hooks vLLM versions after 0.32 ask the connector (no engine): the KV format its
identity names (which versions share blocks), ``kv_cache_access`` (0.34: before the cache is
allocated) and ``may_load_async`` (0.34: ``--max-num-inflight-kv-loads``)."""

from __future__ import annotations

import pytest
import vllm
from test_vllm_sides import ONE_GROUP, _Core
from vllm.config import KVTransferConfig

from kvbridge.bindings.vllm import KV_FORMATS, SUPPORTED_VLLM, KVBridgeConnector, kv_format
from kvbridge.bindings.vllm._groups import Group, KVGroups
from kvbridge.bindings.vllm._scheduler import SchedulerSide

GEMMA = KVGroups((Group(0, "window", 64, ("l0", "l2")), Group(1, "full", 0, ("l1", "l3"))))
QWEN3_NEXT = KVGroups((Group(0, "state", 0, ("l0", "l2")), Group(1, "full", 0, ("l1", "l3"))))


def test_the_supported_versions_share_one_kv_format_and_others_have_their_own() -> None:
    assert tuple(KV_FORMATS) == SUPPORTED_VLLM
    assert kv_format("0.32.0+cpu") == kv_format("0.33.0") == kv_format("0.33.2rc1") == "vllm-kv1"
    assert kv_format(vllm.__version__) == "vllm-kv1"
    assert kv_format("0.34.0") == "vllm-0.34"  # never compared: shares with no other version
    assert kv_format("1.0.0+cu130") == "vllm-1.0"


def _access(transports: str) -> object:
    config = KVTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"server": "127.0.0.1:7400", "transports": transports},
    )
    answer = KVBridgeConnector.kv_cache_access(config)
    return getattr(answer, "name", answer)  # vLLM 0.34's enum, or its name before


def test_the_cache_is_registered_memory_when_ucx_may_carry_it() -> None:
    assert _access("ucx") == "REGISTERS"
    assert _access("auto") == "REGISTERS"
    assert _access("tcp") == "IN_PROCESS"


@pytest.mark.parametrize(
    ("groups", "async_load", "loads", "expected"),
    [
        (ONE_GROUP, False, True, False),  # synchronous loads
        (ONE_GROUP, True, True, True),
        (GEMMA, False, True, True),  # a hybrid model's loads are always async
        (GEMMA, True, False, False),  # a producer loads nothing
        (QWEN3_NEXT, True, True, False),  # a recurrent state: no hits at all
    ],
)
def test_may_load_async_says_what_matched_would_answer(
    groups: KVGroups, async_load: bool, loads: bool, expected: bool
) -> None:
    side = SchedulerSide(
        _Core(),  # type: ignore[arg-type]
        groups,
        loads=loads,
        saves=False,
        async_loads=async_load,
    )
    try:
        assert side.may_load_async() is expected
    finally:
        side.close()
