"""A flood of unauthenticated handshakes and greetings against a real ``kvbridge serve``
whose stderr nobody reads: refusals are counted and logged at a bounded rate, so the
server's threads never block on a full pipe, and a real client is served all the while."""

from __future__ import annotations

import os
import socket
import urllib.request
from pathlib import Path

import msgpack
import numpy as np
import zmq
from attack import data_address
from helpers import free_port, keys, payloads
from serve import ServeProcess

from kvbridge.store import StoreClient
from kvbridge.store.server import metrics_token
from kvbridge.transfer._protocol import Connection, Role

BB = 64 << 10
FLOOD = 5000
"""Refused handshakes: at ~100 bytes a log line, 500 KB, eight times a pipe's buffer."""
GREETINGS = 300
"""Data streams that greet with a forged session."""


def _auth_flood(address: str) -> None:
    """``FLOOD`` auth requests with made-up tickets, sent without waiting for answers."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(f"tcp://{address}")
    for _ in range(FLOOD):
        guess = {
            "op": "auth",
            "name": "flood",
            "principal": "",
            "nonce": os.urandom(16),
            "server_nonce": os.urandom(16),
            "ticket": os.urandom(32),
            "proof": os.urandom(32),
        }
        sock.send_multipart([b"", msgpack.packb(guess)])
    answered = 0
    while answered < FLOOD and sock.poll(10_000):
        sock.recv_multipart()
        answered += 1
    sock.close()
    context.term()
    assert answered == FLOOD  # every one was answered (refused): the control thread ran on


def _greeting_flood(client: StoreClient) -> None:
    """Data streams that open with a HELLO of a session nobody holds."""
    address = data_address(client)
    for index in range(GREETINGS):
        with socket.create_connection((address["host"], address["port"]), timeout=10) as sock:
            conn = Connection(Role.INITIATOR)
            sock.sendall(conn.hello(os.urandom(64), index % 64))
            assert sock.recv(1 << 16) or True  # refused with an ERROR, then closed


def test_a_flood_of_refusals_logs_a_few_lines_and_blocks_nothing(tmp_path: Path) -> None:
    secret = "the real secret"
    (tmp_path / "secret").write_text(secret)
    metrics = free_port()
    server = ServeProcess(
        *("--secret-file", str(tmp_path / "secret"), "--metrics-port", str(metrics)),
        *("--host-capacity", "16MiB"),
    )  # its stderr is a pipe that nobody reads until the end
    try:
        with StoreClient(server.address, block_bytes=BB, namespace="m", secret=secret) as client:
            _auth_flood(server.address)
            _greeting_flood(client)
            ks = keys(0, 4)
            client.put(ks, payloads(ks, BB))  # served at once, the pipe full or not
            out = np.zeros((4, BB), np.uint8)
            client.get(ks, out)
            assert (out == payloads(ks, BB)).all()
        request = urllib.request.Request(f"http://127.0.0.1:{metrics}/metrics")
        request.add_header("Authorization", f"Bearer {metrics_token(secret.encode())}")
        with urllib.request.urlopen(request, timeout=10) as answer:
            text = answer.read().decode()
        assert f'kvbridge_refused_total{{kind="authentication"}} {float(FLOOD)}' in text
        assert f'kvbridge_refused_total{{kind="stream"}} {float(GREETINGS)}' in text
    finally:
        err = server.stop_and_read_log()
    refusals = [line for line in err.splitlines() if "refused" in line]
    assert 1 <= len(refusals) <= 10, refusals
    assert secret not in err
