"""One engine-shaped benchmark client: a KV cache of ``layers`` layers, each one region of
K and V pages (``2 x blocks`` pages of ``page`` bytes), saved and loaded through a
``StoreClient`` one page per op, or the same bytes over raw TCP.

``python _pages_client.py SERVER ECHO_PORT CLIENT_ID LAYERS BLOCKS PAGE_BYTES``; prints
``ready``, then answers each command on stdin with one line:
- ``save``: ``put_pages`` of ``blocks`` fresh keys (unique to this client and save);
- ``load``: ``get_pages`` of the last save's keys;
- ``save-plain`` / ``load-plain``: the same through a client that sends and checks no
  checksums (``checksum_clients.Unchecked``);
- ``check``: every byte of the last load compared with what was saved, then cleared;
- ``rawput`` / ``rawget``: the same bytes over two TCP connections to the echo server, one
  ``sendall`` (or receive) of half of one contiguous buffer each.
"""

from __future__ import annotations

import socket
import sys
import threading
from typing import Any

import numpy as np
from _rig import recv_exact
from checksum_clients import Unchecked

from kvbridge.store import StoreClient

STREAMS = 2
ALIGN = 64
"""The KV cache's alignment, as an engine allocates it (torch's CPU allocator aligns to 64
bytes). numpy's own large arrays start 16 bytes past a page: a kernel copy into such a
destination (a one-sided read over UCX's ``cma``) from an aligned one (the server's slab)
ran at 1.7-1.9 GB/s where aligned ran at 4.0-4.4 (``process_vm_readv``, 32 KiB pages)."""


def _aligned(values: np.ndarray) -> np.ndarray:
    """``values`` copied into memory that starts on an ``ALIGN``-byte boundary."""
    raw = np.empty(values.nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    out = raw[start : start + values.nbytes]
    out[:] = values
    return out


class _Raw:
    """Two connections to the echo server moving halves of one buffer side by side."""

    def __init__(self, port: int, total: int) -> None:
        self.buffer = np.random.default_rng(1).integers(0, 256, total, dtype=np.uint8)
        half = total // STREAMS
        whole = memoryview(self.buffer.data)
        self.halves = [whole[i * half : (i + 1) * half] for i in range(STREAMS)]
        self.conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(STREAMS)]
        for conn in self.conns:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _put(self, i: int) -> None:
        self.conns[i].sendall(b"P")
        self.conns[i].sendall(self.halves[i])
        recv_exact(self.conns[i], memoryview(bytearray(1)))

    def _get(self, i: int) -> None:
        self.conns[i].sendall(b"G")
        recv_exact(self.conns[i], self.halves[i])

    def run(self, put: bool) -> None:
        work = self._put if put else self._get
        threads = [threading.Thread(target=work, args=(i,)) for i in range(1, STREAMS)]
        for t in threads:
            t.start()
        work(0)
        for t in threads:
            t.join()


def main() -> None:
    server, echo_port, client_id, layers_, blocks_, page_ = sys.argv[1:7]
    transport = sys.argv[7] if len(sys.argv) > 7 else "tcp"
    me, layers, blocks, page = int(client_id), int(layers_), int(blocks_), int(page_)
    rng = np.random.default_rng(me)
    saved = [
        _aligned(rng.integers(0, 256, 2 * blocks * page, dtype=np.uint8)) for _ in range(layers)
    ]
    loaded = [_aligned(np.zeros_like(layer)) for layer in saved]
    raw = _Raw(int(echo_port), layers * 2 * blocks * page)
    column = np.arange(blocks, dtype=np.int64) * page
    offsets = np.stack([column + kv * blocks * page for _ in saved for kv in (0, 1)], axis=1)
    shape: dict[str, Any] = {
        "block_bytes": 2 * layers * page,
        "namespace": b"pages",
        "transports": transport,
    }
    with StoreClient(server, **shape) as checked, Unchecked(server, verify=False, **shape) as plain:
        clients = {"": checked, "-plain": plain}
        sources = {
            kind: [region for layer in saved for region in [c.register(layer, access="r")] * 2]
            for kind, c in clients.items()
        }
        targets = {
            kind: [region for layer in loaded for region in [c.register(layer)] * 2]
            for kind, c in clients.items()
        }
        print("ready", flush=True)
        saves = 0
        keys: dict[str, list[bytes]] = {}
        for line in sys.stdin:
            command, _, kind = line.strip().partition("-")
            kind = f"-{kind}" if kind else ""
            if command == "save":
                saves += 1
                keys[kind] = [
                    ((saves * 64 + me) * blocks + i).to_bytes(32, "little") for i in range(blocks)
                ]
                if not all(clients[kind].put_pages(keys[kind], sources[kind], offsets)):
                    raise SystemExit("a save was not stored whole")
            elif command == "load":
                clients[kind].get_pages(keys[kind], targets[kind], offsets)
            elif command == "check":
                if any(layer.any() for layer in loaded):
                    if not all(np.array_equal(a, b) for a, b in zip(saved, loaded, strict=True)):
                        raise SystemExit("loaded pages differ from saved pages")
                    for layer in loaded:
                        layer[:] = 0
            else:
                raw.run(put=command == "rawput")
            print("done", flush=True)


if __name__ == "__main__":
    main()
