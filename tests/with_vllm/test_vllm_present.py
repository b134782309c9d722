"""Says why the vLLM connector's tests did not run here (or that vLLM is there)."""

from __future__ import annotations

import pytest


def test_vllm_is_installed() -> None:
    vllm = pytest.importorskip(
        "vllm",
        reason="vLLM is not installed in this environment: tests/with_vllm/run installs it "
        "(its own venv, .venv-vllm) and runs the connector's tests there",
    )
    assert vllm.__version__.startswith("0.32")
