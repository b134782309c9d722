"""A client that pulls blocks only the server's disk holds, for ``bench_fairness``.

``python _disk_puller.py ADDRESS BLOCK_BYTES FIRST COUNT PER_REQUEST PAUSE_S``: keys
``FIRST`` .. ``FIRST + COUNT`` (stored by the benchmark), a pause of ``PAUSE_S`` after each
request (so that the puller need not take every core). Commands on stdin: ``start`` begins pulling
requests of ``PER_REQUEST`` keys in a loop on a thread; ``stop`` ends it and answers the
number of requests pulled.
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np

from kvbridge.store import StoreClient


def main() -> None:
    address, block_bytes, first, count, per, pause = sys.argv[1:7]
    bb, n, k = int(block_bytes), int(count), int(per)
    keys = [(int(first) + i).to_bytes(32, "little") for i in range(n)]
    out = np.zeros((k, bb), np.uint8)
    stop = threading.Event()
    pulled = [0]
    with StoreClient(address, block_bytes=bb, namespace=b"bench") as client:
        rng = np.random.default_rng(1)

        def pull() -> None:
            while not stop.is_set():
                picked = rng.choice(n, k, replace=False)
                client.get([keys[i] for i in picked], out)
                pulled[0] += 1
                time.sleep(float(pause))

        print("ready", flush=True)
        thread: threading.Thread | None = None
        for line in sys.stdin:
            if line.strip() == "start":
                stop.clear()
                thread = threading.Thread(target=pull)
                thread.start()
            elif thread is not None:
                stop.set()
                thread.join()
                thread = None
                print(pulled[0], flush=True)


if __name__ == "__main__":
    main()
