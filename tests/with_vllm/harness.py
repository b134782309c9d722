"""Shared by the vLLM tests: the tiny model, prompts that share prefixes at block and
non-block boundaries, and engines run in fresh processes."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
BLOCK = 32


def prompts(seed: int = 1) -> list[list[int]]:
    """Six prompts: a 150-token base; prefixes of it ending on a block boundary (64), inside
    a block (70, 40) and past the base's full blocks; one sharing nothing."""
    rng = random.Random(seed)
    base = [rng.randrange(1, 999) for _ in range(150)]
    other = [rng.randrange(1, 999) for _ in range(90)]
    return [base, base[:64] + other[:50], base[:70] + [7] * 30, base[:40], base + other[:20], other]


def run_engine(
    spec: dict[str, Any],
    *,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
) -> dict[str, Any]:
    """Run ``engine_run.py`` with ``spec`` in a fresh process (of ``python``: another
    lane's vLLM); its result (rounds, stats) and its log (``result["log"]``)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as given:
        given.write(json.dumps(spec))
        given.flush()
        proc = _engine_process(python, given.name, timeout, env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"engine failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    result["log"] = proc.stderr
    return result


def _engine_process(
    python: str, spec_path: str, timeout: float, env: dict[str, str] | None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python, str(HERE / "engine_run.py"), spec_path],
        capture_output=True,
        text=True,
        timeout=timeout,
        # vLLM logs to stdout unless told: its log belongs with the connector's, in the
        # result's ``log`` (stdout carries the result)
        env={**os.environ, "VLLM_LOGGING_STREAM": "ext://sys.stderr", **(env or {})},
        check=False,
    )


def namespace_of(log: str) -> tuple[str, int]:
    """The connector's namespace and block bytes, as its start line in an engine's ``log``
    names them."""
    found = re.search(r"kvbridge connector: namespace (\S+), (\d+)-byte blocks", log)
    assert found is not None, "the connector names its namespace in its log"
    return found.group(1), int(found.group(2))


def other_lane() -> tuple[str, str] | None:
    """The Python and vLLM version of another lane's venv (``tests/with_vllm/run`` makes
    ``.venv-vllm``, ``run-0.33`` ``.venv-vllm-0.33``) whose vLLM release is not this one's,
    or ``None`` where none was made."""
    import vllm  # noqa: PLC0415

    mine = vllm.__version__.split("+", maxsplit=1)[0]
    for venv in (".venv-vllm", ".venv-vllm-0.33"):
        root = HERE.parents[1] / venv
        for info in root.glob("lib/python3*/site-packages/vllm*-*.dist-info"):
            version = info.name[: -len(".dist-info")].rsplit("-", maxsplit=1)[1]
            if version != mine and (root / "bin" / "python").exists():
                return str(root / "bin" / "python"), version
    return None


PROMPTS = prompts()
LOADABLE = sum(min(len(p) - 1, len(p) // BLOCK * BLOCK) // BLOCK * BLOCK for p in PROMPTS)
"""Tokens a second instance loads when the first saved every full prompt block: all full
blocks, less the last one where it would leave no token to compute."""


PATHS: dict[str, dict[str, Any]] = {
    "direct": {},
    "staged": {"staging": "always", "staging_bytes": "64KiB"},
}
"""How pages move: straight between vLLM's cache and the server, or through the staging
buffer (the GPU path), two of the tiny model's 32 KiB blocks a chunk."""


LOOKUP_WAIT = 5.0
"""The tests count what loads, not how long a lookup may take: on a loaded 2-core machine
a lookup can take longer than the default ``lookup_wait`` (50 ms), and the request would
then compute its prefix (right, but not what they count). The bound itself is tested by
``test_a_frozen_server_never_holds_the_engine`` and ``test_vllm_sides.py``."""


def spec(model: str, connector: dict[str, Any] | None, **more: Any) -> dict[str, Any]:
    """An engine run over ``PROMPTS`` with ``connector`` (extra config; None: no connector;
    ``lookup_wait`` is :data:`LOOKUP_WAIT` unless it says otherwise)."""
    if connector is not None:
        connector = {"lookup_wait": LOOKUP_WAIT, **connector}
    return {"model": model, "prompts": PROMPTS, "connector": connector, **more}


def tokens(result: dict[str, Any], round_: int = 0) -> list[list[int]]:
    return [out["tokens"] for out in result["rounds"][round_]]
