"""Says why the SGLang backend's tests did not run here (or that sglang is there)."""

from __future__ import annotations

import pytest


def test_sglang_is_installed() -> None:
    sglang = pytest.importorskip(
        "sglang",
        reason="sglang is not installed in this environment: tests/with_sglang/run installs "
        "it (its own venv, .venv-sglang, without its GPU dependencies) and runs the "
        "HiCache backend's tests there",
    )
    assert sglang.__version__ == "0.5.23"
