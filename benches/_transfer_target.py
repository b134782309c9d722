"""The far end of the transfer benchmarks, run as its own process.

It serves a TransferEngine with one 256 MiB region, and a raw-socket baseline: for each
connection a header says (block size, block count, seed, stream, streams, mode); in "bulk"
mode it receives this stream's share of the blocks with ``recv_into`` at the shuffled
offsets the sender used, then answers one byte; in "ping" mode it echoes one byte per block.
It prints the engine metadata (hex) and the raw port, then runs until stdin closes.
"""

from __future__ import annotations

import socket
import struct
import sys
import threading

import numpy as np

from kvbridge.transfer import TransferEngine

TOTAL = 256 << 20
RAW_HEADER = struct.Struct("<QQQIIB")


def shuffled_offsets(block: int, count: int, seed: int) -> np.ndarray:
    """Offsets of ``count`` blocks in shuffled order over the buffer (same on both sides)."""
    slots = TOTAL // block
    return (np.random.default_rng(seed).permutation(slots)[:count] * block).astype(np.int64)


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
    listener = socket.create_server(("127.0.0.1", 0))
    streams = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with TransferEngine("bench-target", streams=streams) as engine:
        engine.register(buffer)
        print(engine.metadata().hex(), listener.getsockname()[1], flush=True)
        threads = []

        def accept() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                thread = threading.Thread(target=_serve_raw, args=(conn, memoryview(buffer)))
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
