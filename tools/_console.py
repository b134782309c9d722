"""Small helpers of the demo's console side: a progress bar, and the loopback link speed
its figures are measured against."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time


class Progress:
    """A progress bar on stderr (a line per tenth when stderr is not a terminal)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.tty = sys.stderr.isatty()

    def update(self, done: int) -> None:
        width = 30
        filled = width * done // self.total
        bar = "#" * filled + "-" * (width - filled)
        end = "" if self.tty else "\n"
        if self.tty or done == self.total or done % max(1, self.total // 10) == 0:
            print(f"\r[{bar}] {done}/{self.total} requests", end=end, file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def loopback_speed(seconds: float = 0.5, chunk: int = 1 << 20) -> float:
    """Bytes per second of one raw TCP stream over loopback (a sender thread, recv here)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def send() -> None:
        with socket.create_connection(("127.0.0.1", port)) as out:
            payload = memoryview(os.urandom(chunk))
            while not stop.is_set():
                out.sendall(payload)

    sender = threading.Thread(target=send, name="kvbridge-linkcheck")
    sender.start()
    conn, _ = listener.accept()
    buffer = bytearray(chunk)
    received = 0
    start = time.perf_counter()
    try:
        while time.perf_counter() - start < seconds:
            n = conn.recv_into(buffer)
            if not n:
                break
            received += n
        elapsed = time.perf_counter() - start
    finally:
        stop.set()
        conn.close()  # the sender's next sendall fails or returns; either way it stops
        sender.join()
        listener.close()
    return received / elapsed
