"""The SGLang backend's tests run against the real ``HiCacheStorage`` of sglang 0.5.23, in a
virtual environment of their own: ``tests/with_sglang/run`` makes it (torch for CPU, the
sglang wheel without its GPU dependencies) and runs them. Where sglang is missing only
``test_sglang_present.py`` is collected, and it skips, saying so."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

if importlib.util.find_spec("sglang") is None:
    collect_ignore = [
        path.name
        for path in Path(__file__).parent.glob("test_*.py")
        if path.name != "test_sglang_present.py"
    ]
