"""The vLLM connector's tests run on a real vLLM 0.32 (CPU) in its own virtual environment:
``tests/vllm/run`` makes it and runs them. Elsewhere each module skips, saying so."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
