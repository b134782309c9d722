"""Strangers holding connections: a process that keeps ``count`` TCP connections open to a
port, opening a new one for each the server closes (at most :data:`REOPEN_PER_S` a
second), as an attacker without any secret would (``StrangerFlood``). Over ZMQ ports
(``zmtp=True``) each connection completes ZMQ's own greeting (ZMTP 3.0, NULL mechanism,
a DEALER), so libzmq holds it as a peer: that is all a stranger can do there without a
secret or a ticket. Run as a script, it is that process: ``python strangers.py PORT COUNT
ZMTP``; it prints ``held`` once it asked for every connection and, on standard input's
end, ``opened N``."""

from __future__ import annotations

import errno
import re
import resource
import selectors
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

from helpers import free_port
from serve import ServeProcess

_SIGNATURE = b"\xff" + b"\x00" * 8 + b"\x7f"
_READY = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
GREETING = (
    (_SIGNATURE + bytes([3, 0]) + b"NULL".ljust(20, b"\x00") + b"\x00" * 32)
    + bytes([0x04, len(_READY)])
    + _READY
)
"""A ZMTP 3.0 greeting (NULL mechanism, as a client) and its READY command (a DEALER)."""
REOPEN_PER_S = 1000
"""How fast closed connections come back: a holding flood, not a connect-rate flood (which
fills any listener's backlog, whoever accepts it: a matter for SYN cookies and firewalls)."""


def every_port(*args: str) -> tuple[ServeProcess, dict[str, int]]:
    """A ``kvbridge serve`` (with ``args``) listening on all four ports, held to 1,024 open
    files (the usual soft limit, and nothing to raise it to); its ports by name."""
    data = free_port()
    served = ServeProcess(
        *args,
        *("--events-port", "0", "--metrics-port", "0", "--data-port", str(data)),
        open_files=(1024, 1024),
    )
    found = dict(re.findall(r"(metrics|events) on :(\d+)", served.line))
    ports = {
        "control": int(served.address.rsplit(":", 1)[1]),
        "events": int(found["events"]),
        "metrics": int(found["metrics"]),
        "data": data,
    }
    return served, ports


class StrangerFlood:
    """``with StrangerFlood(port, count, zmtp=...) as flood: flood.wait_held()``."""

    def __init__(self, port: int, count: int, *, zmtp: bool) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__)), str(port), str(count), str(int(zmtp))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.opened = 0
        """Connections opened in all, known once the flood stopped."""

    def wait_held(self) -> None:
        """Until every connection was open at least once."""
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == "held", f"the flood did not start: {line!r}"

    def stop(self) -> int:
        """Stop the flood; how many connections it opened in all."""
        out, _ = self.proc.communicate(timeout=60)
        self.opened = int(out.split()[-1])
        return self.opened

    def __enter__(self) -> StrangerFlood:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.stop()


def _flood(port: int, count: int, zmtp: bool) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, count + 256)), hard))
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin, selectors.EVENT_READ, None)
    opened = 0

    def open_one() -> None:
        nonlocal opened
        sock = socket.socket()
        sock.setblocking(False)
        if sock.connect_ex(("127.0.0.1", port)) not in (0, errno.EINPROGRESS):
            sock.close()
            return
        opened += 1
        selector.register(sock, selectors.EVENT_WRITE, "connecting")

    for _ in range(count):
        open_one()
    print("held", flush=True)
    closed, budget, refilled = 0, 0.0, time.monotonic()
    while True:
        now = time.monotonic()
        budget = min(REOPEN_PER_S / 10, budget + (now - refilled) * REOPEN_PER_S)
        refilled = now
        while closed and budget >= 1:
            closed, budget = closed - 1, budget - 1
            open_one()
        for key, _ in selector.select(timeout=0.01 if closed else 1.0):
            if key.data is None:
                return opened  # standard input ended: stop
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if key.data == "connecting" and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                if zmtp:
                    sock.send(GREETING)
                selector.modify(sock, selectors.EVENT_READ, "open")
                continue
            try:
                if key.data == "open" and sock.recv(4096):
                    continue  # the server's greeting: a stranger says nothing more
            except OSError:
                pass
            selector.unregister(sock)
            sock.close()
            closed += 1  # closed by the server: another takes its place


if __name__ == "__main__":
    print(f"opened {_flood(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == '1')}", flush=True)
