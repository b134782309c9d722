"""The memory side of the Mooncake store comparison: a ``MooncakeDistributedStore`` that
contributes a global segment (what ``kvbridge serve --host-capacity`` is to kvbridge) and
stores nothing itself. ``python _mooncake_store_holder.py MASTER SEGMENT_BYTES``; prints
``ready``, then runs until stdin closes."""

from __future__ import annotations

import sys

from mooncake.store import MooncakeDistributedStore


def main() -> None:
    master, segment = sys.argv[1], int(sys.argv[2])
    store = MooncakeDistributedStore()
    if store.setup("127.0.0.1", "P2PHANDSHAKE", segment, 16 << 20, "tcp", "", master) != 0:
        raise SystemExit("mooncake store setup failed")
    print("ready", flush=True)
    sys.stdin.read()
    store.close()


if __name__ == "__main__":
    main()
