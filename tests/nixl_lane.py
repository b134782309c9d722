"""Whether this pytest process is the nixl lane: ``tests/with_nixl/run`` runs the suites
that cover the ``nixl`` transport again in a process of its own, with
``KVBRIDGE_TEST_NIXL=1``, where only their nixl cases run. NIXL's UCX and ucxx's do not
share a process (``transfer/_ucx_builds.py``), so the main process runs no nixl case and
the lane's no ucx one."""

from __future__ import annotations

import os

NIXL_LANE = os.environ.get("KVBRIDGE_TEST_NIXL") == "1"
