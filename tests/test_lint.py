"""The code base stays ruff- and mypy-clean (both come with the `test` extra)."""

from __future__ import annotations

import os
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


def _mypy(*args: str) -> None:
    helpers = os.pathsep.join(
        str(ROOT / d) for d in ("tests", "tests/with_vllm", "tests/with_sglang")
    )
    env = {**os.environ, "MYPYPATH": helpers}  # benches and the engine tests import helpers
    result = subprocess.run(
        [*_tool("mypy"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@_NUMPY_TYPED
def test_mypy_strict_is_clean() -> None:
    _mypy()  # the package, as pyproject's [tool.mypy] says


# One run per folder: tests/, tests/with_vllm/, tests/with_sglang/ and benches/ each have a
# conftest.py, so one run over them all reports a duplicate module.
@_NUMPY_TYPED
@pytest.mark.parametrize(
    "folder",
    [
        ("tests", "--exclude", "tests/with_vllm/", "--exclude", "tests/with_sglang/"),
        ("tests/with_vllm",),
        ("tests/with_sglang",),
        ("benches",),
    ],
    ids=str,
)
def test_mypy_strict_is_clean_over(folder: tuple[str, ...]) -> None:
    _mypy("--strict", *folder)
