"""vLLM's sleep mode and the connector: it answers that it does not support it, on vLLM's
own types, whatever the installed vLLM declares. vLLM 0.33 added the hook
(``KVConnectorBase_V1.supports_sleep_mode``, a classmethod taking the
``KVTransferConfig``, True by default) and refuses ``--enable-sleep-mode`` at start with a
connector that answers False; vLLM 0.32 (``tests/with_vllm/run``'s) has no hook and never
asks. The first two tests hold on both; the third runs vLLM's own start-up check where
there is one (``tests/with_vllm/run-0.33``'s vLLM)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from kvbridge.bindings.vllm import KVBridgeConnector

ROLES = ("kv_both", "kv_producer", "kv_consumer")
HOOK_PARAMETERS = ["kv_transfer_config"]
"""``supports_sleep_mode``'s parameters (after ``cls``) as vLLM 0.33's base declares them."""


def _transfer_config(role: str) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="KVBridgeConnector",
        kv_connector_module_path="kvbridge.bindings.vllm",
        kv_role=role,
        kv_connector_extra_config={"server": "127.0.0.1:7400"},
    )


@pytest.mark.parametrize("role", ROLES)
def test_the_connector_vllm_loads_says_it_does_not_support_sleep_mode(role: str) -> None:
    """The class vLLM's factory finds for our ``--kv-transfer-config`` (as its start-up
    check finds it) answers False for the config, in every role."""
    config = _transfer_config(role)
    connector = KVConnectorFactory.get_connector_class(config)
    assert connector is KVBridgeConnector
    assert connector.supports_sleep_mode(config) is False


def test_the_hook_is_declared_as_vllms_base_declares_it() -> None:
    """A classmethod taking the transfer config: where the installed base declares the hook
    (vLLM 0.33 on), ours overrides it with the same parameters and the base's own answer is
    True (so False is ours); where it does not, ours has vLLM 0.33's parameters."""
    ours = inspect.getattr_static(KVBridgeConnector, "supports_sleep_mode")
    assert isinstance(ours, classmethod)
    parameters = list(inspect.signature(KVBridgeConnector.supports_sleep_mode).parameters)
    base = inspect.getattr_static(KVConnectorBase_V1, "supports_sleep_mode", None)
    if base is None:
        assert parameters == HOOK_PARAMETERS
        return
    assert isinstance(base, classmethod)
    assert parameters == list(inspect.signature(KVConnectorBase_V1.supports_sleep_mode).parameters)
    assert KVConnectorBase_V1.supports_sleep_mode(_transfer_config("kv_both")) is True


def test_vllms_start_up_check_refuses_sleep_mode_with_the_connector() -> None:
    """vLLM's own check (``VllmConfig._verify_kv_transfer_compat``, run when a config is
    made) on a config with sleep mode on and our connector: refused, naming it."""
    if inspect.getattr_static(KVConnectorBase_V1, "supports_sleep_mode", None) is None:
        pytest.skip("this vLLM has no sleep mode hook and never asks (0.33 added it)")
    config = SimpleNamespace(
        kv_transfer_config=_transfer_config("kv_both"),
        model_config=SimpleNamespace(enable_sleep_mode=True, enable_cumem_allocator=True),
    )
    with pytest.raises(ValueError, match="KVBridgeConnector does not support sleep mode"):
        VllmConfig._verify_kv_transfer_compat(config)
