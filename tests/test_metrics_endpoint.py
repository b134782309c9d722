"""The metrics port of a real ``kvbridge serve`` against a slow loris: silent connections
cost the server no thread each, are closed (the oldest at the cap, every one at the request
deadline), and a scraper with the token is answered all the while."""

from __future__ import annotations

import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import free_port
from serve import ServeProcess

from kvbridge.store.server import metrics_token

SILENT = 200
SECRET = b"metrics test secret"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[ServeProcess, int]]:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    port = free_port()
    server = ServeProcess("--secret-file", str(secret), "--metrics-port", str(port))
    try:
        yield server, port
    finally:
        server.kill()


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _scrape(port: int, token: str | None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, ""


def _closed_by_server(sock: socket.socket, timeout: float) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except (TimeoutError, OSError) as exc:
        return isinstance(exc, ConnectionResetError)


@pytest.mark.slow
def test_silent_connections_hold_no_thread_and_a_scrape_is_answered(
    server: tuple[ServeProcess, int],
) -> None:
    serve, port = server
    pid = serve.proc.pid
    assert _scrape(port, metrics_token(SECRET))[0] == 200
    before = _threads(pid)
    silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(SILENT)]
    try:
        for sock in silent[:10]:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # a request head that never ends
        status, text = _scrape(port, metrics_token(SECRET))
        assert status == 200 and "kvbridge_request_seconds" in text
        assert _threads(pid) <= before  # not a thread per connection
        assert _scrape(port, None)[0] == 401
        assert _scrape(port, "wrong")[0] == 401
        # Past the cap, the oldest silent ones were closed at once; the rest at the
        # request deadline (5 s): none is held open for good.
        deadline = time.monotonic() + 30
        for sock in silent:
            assert _closed_by_server(sock, max(0.1, deadline - time.monotonic()))
    finally:
        for sock in silent:
            sock.close()
    assert _scrape(port, metrics_token(SECRET))[0] == 200


def test_a_request_head_that_is_too_long_is_dropped(server: tuple[ServeProcess, int]) -> None:
    _, port = server
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nX-Filler: " + b"x" * (64 << 10))
        assert _closed_by_server(sock, 10)
    assert _scrape(port, metrics_token(SECRET))[0] == 200


def test_head_says_the_length_of_a_scrape_without_it(server: tuple[ServeProcess, int]) -> None:
    _, port = server
    headers = {"Authorization": f"Bearer {metrics_token(SECRET)}"}
    head = urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics", headers=headers, method="HEAD"
    )
    with urllib.request.urlopen(head, timeout=10) as answer:
        assert answer.read() == b""
        length = int(answer.headers["Content-Length"])
    assert length > 1000  # the figures' text, as long as a GET would get (give or take)
