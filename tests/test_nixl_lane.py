"""The nixl lane: the suites that cover the one-sided ``nixl`` transport (conformance,
``test_nixl``, the server's, trust and fault suites) run their nixl cases in a pytest
process of their own (``KVBRIDGE_TEST_NIXL=1``, ``-k nixl``): NIXL's UCX and ucxx's do not
share a process (``transfer/_ucx_builds.py``: with NIXL agents made first, the ucx
transport crashed the process), and the main process runs the ucx cases."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from nixl_lane import NIXL_LANE

from kvbridge.transfer._nixl_agent import nixl_available

HERE = Path(__file__).parent
SUITES = [
    "test_transfer.py",
    "test_nixl.py",
    "test_server.py",
    "test_trust.py",
    "test_trust_limits.py",
    "test_server_death.py",
]


@pytest.mark.slow
@pytest.mark.skipif(NIXL_LANE, reason="the lane itself")
@pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1)"
)
def test_the_nixl_lane_passes() -> None:
    """Every nixl case passes in the lane's process, and there is at least one of each
    suite's (the lane is not empty by a typo)."""
    env = {**os.environ, "KVBRIDGE_TEST_NIXL": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "nixl"]
    done = subprocess.run(
        [*command, *(str(HERE / suite) for suite in SUITES)],
        cwd=HERE.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    tail = (done.stdout + done.stderr)[-8000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout and " failed" not in done.stdout, tail
