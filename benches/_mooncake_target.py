"""The far end of the Mooncake comparison: a Mooncake TCP engine with one 256 MiB buffer.

Prints ``session_id buffer_address``, then runs until stdin closes.
"""

from __future__ import annotations

import sys

import numpy as np
from mooncake.engine import TransferEngine

TOTAL = 256 << 20


def main() -> None:
    engine = TransferEngine()
    if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("mooncake initialize failed")
    buffer = np.zeros(TOTAL, np.uint8)
    if engine.register_memory(buffer.ctypes.data, TOTAL) != 0:
        raise SystemExit("mooncake register_memory failed")
    print(f"127.0.0.1:{engine.get_rpc_port()}", buffer.ctypes.data, flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
