"""Engine-shaped pages through one ``kvbridge serve`` on loopback, against raw TCP moving
the same bytes in the same run.

A vLLM worker saving or loading a 1,000-token prefix of Llama-3-8B (32 layers, 8 KV heads,
head_dim 128, bf16, 16-token blocks) moves 63 blocks x 32 layers x (K, V) = 4,032 pages of
32 KiB (132 MB). Each client process (``_pages_client.py``) holds such a KV cache and saves
it with ``put_pages`` (fresh keys each time) and loads it with ``get_pages``, one op per
page. Baseline: the same processes moving the same bytes to a threaded echo server over two
TCP connections each, one ``sendall`` of half the bytes per connection. With one client and
with 8 (each its own prefix) side by side on one server; the server's CPU time per GiB moved
(``/proc/PID/stat``, user + system) beside the echo server's. And the same saves and loads
with end-to-end checksums against a client that sends and checks none (``verify`` off).

``KVB_PAGE_KIB`` (32) and ``KVB_PAGE_CLIENTS`` ("1,8") change the shape;
``KVB_PAGE_TRANSPORT`` (tcp) the transport of the server and its clients (``ucx``, or
``nixl`` with ``KVBRIDGE_NIXL_UCX_TLS`` for NIXL's UCX: ``sm,self`` or ``tcp``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _rig
import pytest
from conftest import _EXTRA_LINES

LAYERS = 32
BLOCKS = 63
PAGE = int(os.environ.get("KVB_PAGE_KIB", "32")) << 10
CLIENT_COUNTS = [int(n) for n in os.environ.get("KVB_PAGE_CLIENTS", "1,8").split(",")]
TRANSPORT = os.environ.get("KVB_PAGE_TRANSPORT", "tcp")
TOTAL = LAYERS * 2 * BLOCKS * PAGE
"""Bytes one client saves or loads per round."""


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class _Rig:
    def __init__(self, clients: int) -> None:
        capacity = f"{max(1, 5 * clients * TOTAL >> 30) + 1}GiB"
        self.server, address = _rig.serve(
            "--host-capacity", capacity, "--max-namespaces", "1", "--transports", TRANSPORT
        )
        self.echo, echo_port = _rig.echo_server(TOTAL // 2)
        shape = (str(LAYERS), str(BLOCKS), str(PAGE))
        self.clients = [
            _rig.script("_pages_client.py", address, echo_port, str(i), *shape, TRANSPORT)
            for i in range(clients)
        ]
        _rig.wait_ready(self.clients)
        self.cpu = {"store": 0.0, "raw": 0.0}

    def all(self, command: str) -> None:
        """Every client runs ``command`` at once; returns when the last one is done."""
        for client in self.clients:
            assert client.stdin is not None
            client.stdin.write(command + "\n")
            client.stdin.flush()
        for client in self.clients:
            assert client.stdout is not None
            if client.stdout.readline().strip() != "done":
                raise RuntimeError(f"a client failed at {command!r}")

    def timed_cpu(self, kind: str, command: str) -> Callable[[], None]:
        """``command`` on every client, adding the serving process's CPU time to ``kind``."""
        pid = (self.server if kind == "store" else self.echo).pid

        def run() -> None:
            before = _cpu_seconds(pid)
            self.all(command)
            self.cpu[kind] += _cpu_seconds(pid) - before

        return run

    def close(self) -> None:
        _rig.close(self.server, [*self.clients, self.echo])


@pytest.fixture(scope="module", params=CLIENT_COUNTS, ids=lambda n: f"{n}clients")
def rig(request: pytest.FixtureRequest) -> Iterator[_Rig]:
    r = _Rig(int(request.param))
    yield r
    r.close()


@pytest.mark.parametrize("direction", ["save", "load"])
def test_engine_pages(compare: Callable[..., Any], rig: _Rig, direction: str) -> None:
    clients = len(rig.clients)
    if direction == "load":
        rig.all("save")
    rounds = 7 if clients > 1 else 15
    rig.cpu = {"store": 0.0, "raw": 0.0}
    compare(
        f"{clients} client(s), {LAYERS * 2 * BLOCKS} x {PAGE >> 10} KiB pages, {direction}, "
        f"{TRANSPORT}",
        rig.timed_cpu("store", direction),
        rig.timed_cpu("raw", "rawput" if direction == "save" else "rawget"),
        baseline_name="raw TCP, 2 sendalls per client",
        nbytes=clients * TOTAL,
        rounds=rounds,
        warmup=1,
        setup=(lambda: rig.all("check")) if direction == "load" else None,
    )
    moved_gib = (rounds + 1) * clients * TOTAL / (1 << 30)
    line = (
        f"{clients} client(s) {direction}: server CPU {rig.cpu['store'] / moved_gib:.2f} s/GiB"
        f"  vs raw echo server {rig.cpu['raw'] / moved_gib:.2f} s/GiB"
    )
    _EXTRA_LINES.append(line)
    print(line)


@pytest.mark.parametrize("direction", ["save", "load"])
def test_engine_pages_checksums(compare: Callable[..., Any], rig: _Rig, direction: str) -> None:
    """The saves and loads above with their checksums (written as they are sent, checked as
    they land) against the same client without (``checksum_clients.Unchecked``)."""
    clients = len(rig.clients)
    if direction == "load":
        rig.all("save")
        rig.all("save-plain")
    compare(
        f"{clients} client(s), {LAYERS * 2 * BLOCKS} x {PAGE >> 10} KiB pages, {direction}, "
        f"{TRANSPORT}, checksums",
        lambda: rig.all(direction),
        lambda: rig.all(f"{direction}-plain"),
        baseline_name="no checksums",
        nbytes=clients * TOTAL,
        rounds=7 if clients > 1 else 15,
        warmup=1,
    )
