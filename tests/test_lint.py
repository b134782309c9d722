"""The code base stays ruff- and mypy-clean (both come with the `test` extra)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> list[str]:
    if shutil.which(name, path=str(Path(sys.executable).parent)) is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return [sys.executable, "-m", name]


def test_ruff_is_clean() -> None:
    for args in (["check", "."], ["format", "--check", "."]):
        result = subprocess.run(
            [*_tool("ruff"), *args], cwd=ROOT, capture_output=True, text=True, check=False
        )
        assert result.returncode == 0, result.stdout + result.stderr


_NUMPY_TYPED = pytest.mark.skipif(
    tuple(int(x) for x in np.__version__.split(".")[:2]) < (2, 3),
    reason="the code is typed against numpy >= 2.3 (Python >= 3.11), whose ndarray has "
    "default type parameters; older numpy stubs want them spelled out under --strict",
)


@_NUMPY_TYPED
def test_mypy_strict_is_clean() -> None:
    """One strict build over the package, tests/ (the engine lanes' too) and benches/
    (tests/typecheck.py: mypy's command line cannot take the four conftest.py at once)."""
    _tool("mypy")  # skips where mypy is not installed
    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "typecheck.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
