"""``kvbridge demo --servers 3`` (a cluster of three on etcd) against ``kvbridge demo`` (one
server), same workload, same machine, run alternately: the throughput each reports
(loaded + pushed + pulled bytes over its wall time; every block checked byte for byte)
and the ratio of their medians (goal: >= 0.8x)."""

from __future__ import annotations

import re
import statistics
import subprocess
import sys

import pytest
from conftest import _EXTRA_LINES

from kvbridge.tools._etcd_process import etcd_binary

try:
    etcd_binary()
except FileNotFoundError as exc:
    pytest.skip(f"no etcd: {exc}", allow_module_level=True)

RUNS = 3


def _throughput(*args: str) -> float:
    """GB/s the demo reported."""
    done = subprocess.run(
        [sys.executable, "-m", "kvbridge", "demo", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    found = re.search(r"throughput\s+([0-9.]+) GB/s", done.stdout)
    assert found, done.stdout[-2000:]
    return float(found.group(1))


def test_demo_on_three_servers_against_one() -> None:
    one: list[float] = []
    three: list[float] = []
    for _ in range(RUNS):
        one.append(_throughput())
        three.append(_throughput("--servers", "3"))
    ratio = statistics.median(three) / statistics.median(one)
    line = (
        f"kvbridge demo --servers 3: {statistics.median(three):.2f} GB/s (runs "
        f"{', '.join(f'{t:.2f}' for t in three)}) against kvbridge demo "
        f"{statistics.median(one):.2f} GB/s ({', '.join(f'{t:.2f}' for t in one)}): "
        f"ratio {ratio:.2f}"
    )
    _EXTRA_LINES.append(line)
    print(line)
