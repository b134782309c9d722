"""The vLLM connector's tests run on a real vLLM (CPU) in a virtual environment of its own,
one lane for each supported version (``kvbridge.bindings.vllm.SUPPORTED_VLLM``):
``tests/with_vllm/run`` makes vLLM 0.32's and runs them there, ``tests/with_vllm/run-0.33``
vLLM 0.33's. Where vLLM is missing only ``test_vllm_present.py`` is collected, and it skips,
saying so."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

if importlib.util.find_spec("vllm") is None:
    collect_ignore = [
        path.name
        for path in Path(__file__).parent.glob("test_*.py")
        if path.name != "test_vllm_present.py"
    ]
else:
    from harness import PROMPTS, run_engine, tokens
    from tiny import make_model

    @pytest.fixture(scope="session")
    def model(tmp_path_factory: pytest.TempPathFactory) -> str:
        """The tiny random Llama, written once per session."""
        return str(make_model(tmp_path_factory.mktemp("model")))

    @pytest.fixture(scope="session")
    def baseline_run(model: str) -> dict[str, Any]:
        """The same vLLM without a connector over ``PROMPTS``: its outputs and seconds."""
        return run_engine({"model": model, "prompts": PROMPTS, "connector": None})

    @pytest.fixture(scope="session")
    def baseline(baseline_run: dict[str, Any]) -> list[list[int]]:
        """Greedy outputs of the same vLLM without a connector, for ``PROMPTS``."""
        return tokens(baseline_run)
