"""The far end of ``kvbridge bench`` and of the transfer benchmarks, run as its own process:
``python -m kvbridge.tools._bench_target [STREAMS [TRANSPORTS [HOST]]]``.

It serves a TransferEngine with one 256 MiB region, and a raw-socket baseline: for each
connection a header says (block size, block count, seed, stream, streams, mode); in "bulk"
mode it receives this stream's share of the blocks with ``recv_into`` at the shuffled
offsets the sender used, then answers one byte; in "ping" mode it echoes one byte per block.
It prints one line, ``READY`` then the engine metadata (hex) and the raw port, then runs
until stdin closes.
"""

from __future__ import annotations

import socket
import sys
import threading

import numpy as np

from kvbridge.tools._bench_wire import RAW_HEADER, READY, TOTAL, shuffled_offsets
from kvbridge.transfer import TransferEngine


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if n == 0:
            raise EOFError
        view = view[n:]


def _serve_raw(conn: socket.socket, buffer: memoryview) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    header = bytearray(RAW_HEADER.size)
    with conn:
        try:
            while True:
                _recv_exact(conn, memoryview(header))
                block, count, seed, stream, streams, mode = RAW_HEADER.unpack(header)
                offsets = shuffled_offsets(block, count, seed)[stream::streams].tolist()
                if mode == 0:
                    for offset in offsets:
                        _recv_exact(conn, buffer[offset : offset + block])
                    conn.sendall(b"k")
                else:
                    for offset in offsets:
                        _recv_exact(conn, buffer[offset : offset + block])
                        conn.sendall(b"k")
        except (EOFError, OSError):
            return


def main() -> None:
    buffer = np.zeros(TOTAL, np.uint8)
    streams = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    transports = sys.argv[2].split(",") if len(sys.argv) > 2 else ["tcp"]
    host = sys.argv[3] if len(sys.argv) > 3 else "127.0.0.1"
    listener = socket.create_server((host, 0))
    with TransferEngine(
        "bench-target", host=host, streams=streams, transports=transports
    ) as engine:
        engine.register(buffer)
        print(READY, engine.metadata().hex(), listener.getsockname()[1], flush=True)
        threads = []

        def accept() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                thread = threading.Thread(target=_serve_raw, args=(conn, buffer.data))
                thread.start()
                threads.append(thread)

        acceptor = threading.Thread(target=accept)
        acceptor.start()
        sys.stdin.read()
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        acceptor.join()
        for thread in threads:
            thread.join()


if __name__ == "__main__":
    main()
