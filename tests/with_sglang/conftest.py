"""The SGLang backend's tests run against the real ``HiCacheStorage`` of sglang 0.5.23, in a
virtual environment of their own: ``tests/with_sglang/run`` makes it (torch for CPU, the
sglang wheel without its GPU dependencies) and runs them. Where sglang is missing only
``test_sglang_present.py`` is collected, and it skips, saying so."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

if importlib.util.find_spec("sglang") is None:
    collect_ignore = [
        path.name
        for path in Path(__file__).parent.glob("test_*.py")
        if path.name != "test_sglang_present.py"
    ]
else:
    from sglang.srt import runtime_context
    from sglang.srt.arg_groups.fields.model import Model

    @pytest.fixture(scope="session")
    def model_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
        """A model folder (a config and some bytes of weights) for SGLang to have loaded."""
        folder = tmp_path_factory.mktemp("model") / "m"
        folder.mkdir()
        (folder / "config.json").write_text('{"model_type": "llama"}')
        (folder / "model.safetensors").write_bytes(bytes(range(256)) * 16)
        return folder

    @pytest.fixture(autouse=True)
    def published_model(model_files: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """SGLang's scheduler publishes its model settings before it builds the cache
        controller; every test runs as in that process unless it says otherwise. The real
        bag (``runtime_context.get_model()``) imports ``sglang.srt.configs``, which needs
        transformers and torchvision (no CPU wheel of it here), so SGLang's own ``Model``
        namespace record, with its fields and defaults, stands in for it."""
        model = Model(model_path=str(model_files))
        monkeypatch.setattr(runtime_context, "get_model", lambda: model)
