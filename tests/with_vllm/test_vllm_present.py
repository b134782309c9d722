"""Says why the vLLM connector's tests did not run here (or that vLLM is there, in a version
the connector supports)."""

from __future__ import annotations

import pytest


def test_vllm_is_installed() -> None:
    vllm = pytest.importorskip(
        "vllm",
        reason="vLLM is not installed in this environment: tests/with_vllm/run installs it "
        "(its own venv, .venv-vllm; tests/with_vllm/run-0.33 for vLLM 0.33) and runs the "
        "connector's tests there",
    )
    from kvbridge.bindings.vllm import SUPPORTED_VLLM  # noqa: PLC0415  (imports vLLM)

    release = ".".join(vllm.__version__.split(".")[:2])  # "0.32.0+cpu" -> "0.32"
    assert release in SUPPORTED_VLLM, f"vLLM {vllm.__version__}, supported {SUPPORTED_VLLM}"
