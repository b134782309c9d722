"""The processes of the many-client benchmarks (``bench_server.py``, ``bench_engine_pages.py``):
a ``kvbridge serve``, the raw TCP baseline's echo server, and client scripts of this folder
driven line by line over their standard input and output."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from kvbridge.tools._serve_cmds import read_listening

HERE = Path(__file__).parent


def serve(*args: str) -> tuple[subprocess.Popen[str], str]:
    """A ``kvbridge serve --port 0`` with ``args``, and the address it listens on."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge", "serve", "--port", "0", *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    address, _ = read_listening(proc.stdout)
    return proc, address


def script(name: str, *args: str) -> subprocess.Popen[str]:
    """``python benches/NAME ARGS``, its standard input and output piped (text)."""
    return subprocess.Popen(
        [sys.executable, str(HERE / name), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def echo_server(payload_bytes: int) -> tuple[subprocess.Popen[str], str]:
    """``_echo_server.py`` for payloads of ``payload_bytes``, and its port."""
    proc = script("_echo_server.py", str(payload_bytes))
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def wait_ready(clients: list[subprocess.Popen[str]]) -> None:
    """Each client script said ``ready``."""
    for client in clients:
        assert client.stdout is not None and client.stdout.readline().strip() == "ready"


def close(server: subprocess.Popen[str], others: list[subprocess.Popen[str]]) -> None:
    """Close the scripts' standard input (they end), then stop the server."""
    for proc in others:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(30)
    server.terminate()
    server.wait(30)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (the clients' side of the raw baseline)."""
    while view:
        n = sock.recv_into(view)
        if not n:
            raise EOFError("the echo server went away")
        view = view[n:]
