"""One strict mypy build over all the Python the repository holds: the package, ``tests/``
(with the engine lanes' ``tests/with_vllm/`` and ``tests/with_sglang/``) and ``benches/``.
``python tests/typecheck.py`` prints what mypy prints and exits 1 on an error, 2 on one that
stops the build; ``tests/test_lint.py`` runs it.

mypy's command line cannot take these folders in one run: each has a ``conftest.py``, and
all four are a top-level module named ``conftest`` ("Duplicate module named 'conftest'").
Only ``benches/`` imports its own by that name (``from conftest import _EXTRA_LINES``), so it
keeps the name and the others are checked under names of their own that nothing imports
(``tests_conftest``, ``tests_with_vllm_conftest``, ...). Otherwise this is the build that
``mypy --strict kvbridge tests benches`` would make, under ``[tool.mypy]`` of pyproject.toml.
"""

from __future__ import annotations

import os
from pathlib import Path

from mypy import build
from mypy.errors import CompileError
from mypy.main import process_options
from mypy.modulefinder import BuildSource
from mypy.util import hard_exit

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ["kvbridge", "tests", "benches"]
IMPORTED_AS_CONFTEST = Path("benches/conftest.py")
"""The one ``conftest.py`` that modules import by its name."""


def _named_apart(source: BuildSource) -> BuildSource:
    """``source``, or a ``conftest.py`` other than benches' under a name of its own."""
    path = Path(source.path or "")
    if source.module != "conftest" or path == IMPORTED_AS_CONFTEST:
        return source
    name = "_".join(path.parent.parts) + "_conftest"
    return BuildSource(source.path, name, source.text, source.base_dir, source.followed)


def main() -> int:
    os.chdir(ROOT)  # mypy reads [tool.mypy] from the working folder's pyproject.toml
    sources, options = process_options(["--strict", *FOLDERS])
    named = [_named_apart(source) for source in sources]
    try:
        result = build.build(named, options)
    except CompileError as stop:  # a syntax error, a module found twice, ...
        print("\n".join(stop.messages))
        return 2
    if result.errors:
        print("\n".join(result.errors))
    errors = sum(": error:" in message for message in result.errors)
    print(f"{errors} errors in {len(named)} source files")
    return 1 if errors else 0


if __name__ == "__main__":
    # As mypy's own command does: exit without tearing the build down (seconds of freeing).
    hard_exit(main())
