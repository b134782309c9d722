"""One benchmark client process: a StoreClient and a raw TCP socket to an echo server.

Commands on stdin, one per line; each answers one JSON line of per-request latencies (s):
- ``store ROUND``: push ``requests`` requests of ``per_request`` fresh blocks (keys unique
  to this client and round), then pull them back, checking the first byte of each block.
- ``raw``: the same bytes over the raw socket: per request ``P`` + payload, answered by one
  byte, then ``G``, answered by the payload.
"""

from __future__ import annotations

import json
import socket
import sys
import time

import numpy as np
from _rig import recv_exact

from kvbridge.store import StoreClient


def main() -> None:
    server, echo_port, client_id, block_bytes, per_request, requests = sys.argv[1:7]
    bb, per, count, me = int(block_bytes), int(per_request), int(requests), int(client_id)
    data = np.random.default_rng(me).integers(0, 256, (count, per, bb), dtype=np.uint8)
    out = np.zeros_like(data)
    raw = socket.create_connection(("127.0.0.1", int(echo_port)))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reply = bytearray(per * bb)
    with StoreClient(server, block_bytes=bb, namespace=b"bench") as client:
        region_in = client.register(data.reshape(-1), access="r")
        region_out = client.register(out.reshape(-1))
        offsets = [[(r * per + i) * bb for i in range(per)] for r in range(count)]
        print("ready", flush=True)
        for line in sys.stdin:
            command = line.split()
            push: list[float] = []
            pull: list[float] = []
            if command[0] == "store":
                round_ = int(command[1])
                keys = [
                    [
                        (((round_ * 64 + me) * count + r) * per + i).to_bytes(32, "little")
                        for i in range(per)
                    ]
                    for r in range(count)
                ]
                for r in range(count):
                    start = time.perf_counter()
                    client.put_from(keys[r], region_in, offsets[r])
                    push.append(time.perf_counter() - start)
                for r in range(count):
                    start = time.perf_counter()
                    client.get_into(keys[r], region_out, offsets[r])
                    pull.append(time.perf_counter() - start)
                if not np.array_equal(out[:, :, 0], data[:, :, 0]):
                    raise SystemExit("pulled bytes differ from pushed bytes")
            else:
                for r in range(count):
                    start = time.perf_counter()
                    raw.sendall(b"P")
                    raw.sendall(memoryview(data[r]).cast("B"))
                    recv_exact(raw, memoryview(reply)[:1])
                    push.append(time.perf_counter() - start)
                for _ in range(count):
                    start = time.perf_counter()
                    raw.sendall(b"G")
                    recv_exact(raw, memoryview(reply))
                    pull.append(time.perf_counter() - start)
            print(json.dumps({"push": push, "pull": pull}), flush=True)
    raw.close()


if __name__ == "__main__":
    main()
