"""The far end of the NIXL comparison: a NIXL agent (UCX backend) with one 256 MiB buffer.

The agent runs as NIXL's Python API makes it by default (its progress thread on), with UCX
error handling off (``ucx_error_handling_mode=none``: UCX's shared-memory transports have no
peer failure handler, and NIXL's default, ``peer``, refuses them). UCX_TLS comes from the
environment. Prints one line, ``NIXL-TARGET`` then the agent metadata (hex) and the buffer's
address; then answers each stdin line ``OFFSET LENGTH`` with the BLAKE2b digest (hex) of
those bytes of the buffer, until stdin closes.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
from types import ModuleType

import numpy as np

TOTAL = 256 << 20
READY = "NIXL-TARGET"
UCX_PARAMS = {"ucx_error_handling_mode": "none"}


def nixl_api() -> ModuleType:
    """NIXL's Python API: ``nixl_cu12`` (the CUDA 12 wheel) or the ``nixl`` meta-package."""
    for name in ("nixl_cu12._api", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("neither nixl_cu12 nor nixl is installed")


def main() -> None:
    api = nixl_api()
    agent = api.nixl_agent("kvbridge-bench-target", api.nixl_agent_config(backends=[]))
    agent.create_backend("UCX", UCX_PARAMS)
    buffer = np.zeros(TOTAL, np.uint8)
    descs = agent.register_memory([(buffer.ctypes.data, TOTAL, 0, "")], "DRAM")
    print(READY, agent.get_agent_metadata().hex(), buffer.ctypes.data, flush=True)
    for line in sys.stdin:
        offset, length = map(int, line.split())
        print(hashlib.blake2b(buffer.data[offset : offset + length]).hexdigest(), flush=True)
    agent.deregister_memory(descs)


if __name__ == "__main__":
    main()
