"""Many clients through one cache server on loopback, against raw TCP in the same run.

Eight client processes each push 16 requests of fresh blocks (4 MiB per request: 4 blocks of
1 MiB or 64 of 64 KiB) into one ``kvbridge serve`` process, then pull them back; a round is
all eight doing that at once (512 MiB pushed and 512 MiB pulled). Baseline: the same eight
processes moving the same bytes per request over one raw TCP connection each to a threaded
echo server (``P`` + payload answered by one byte, ``G`` answered by the payload). Reported:
aggregate throughput (pushed + pulled bytes over the round's wall time) and the ratio, and
per-request latency percentiles of both.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import _rig
import numpy as np
import pytest
from conftest import _EXTRA_LINES

CLIENTS = int(os.environ.get("KVB_CLIENTS", "8"))
REQUESTS = 16
REQUEST_BYTES = 4 << 20


class _Rig:
    def __init__(self, block_bytes: int) -> None:
        per = REQUEST_BYTES // block_bytes
        policy = os.environ.get("KVBRIDGE_BENCH_POLICY", "reuse")
        self.server, self.address = _rig.serve(
            *("--host-capacity", "2GiB", "--max-namespaces", "1", "--policy", policy)
        )
        self.echo, echo_port = _rig.echo_server(REQUEST_BYTES)
        shape = (str(block_bytes), str(per), str(REQUESTS))
        self.clients = [
            _rig.script("_server_client.py", self.address, echo_port, str(i), *shape)
            for i in range(CLIENTS)
        ]
        _rig.wait_ready(self.clients)
        self.rounds = itertools.count()
        self.latency: dict[str, list[float]] = {"store": [], "raw": []}

    def round(self, kind: str) -> None:
        command = f"store {next(self.rounds)}\n" if kind == "store" else "raw\n"
        for client in self.clients:
            assert client.stdin is not None
            client.stdin.write(command)
            client.stdin.flush()
        for client in self.clients:
            assert client.stdout is not None
            result = json.loads(client.stdout.readline())
            self.latency[kind] += result["push"] + result["pull"]

    def close(self) -> None:
        _rig.close(self.server, [*self.clients, self.echo])


@pytest.fixture(scope="module", params=[1 << 20, 64 << 10], ids=["1MiB", "64KiB"])
def rig(request: pytest.FixtureRequest) -> Iterator[_Rig]:
    r = _Rig(int(request.param))
    r.block_bytes = int(request.param)  # type: ignore[attr-defined]
    yield r
    r.close()


def test_concurrent_clients_push_and_pull(compare: Callable[..., Any], rig: _Rig) -> None:
    block_kib = rig.block_bytes >> 10  # type: ignore[attr-defined]
    compare(
        f"server, {CLIENTS} clients, {block_kib} KiB blocks",
        lambda: rig.round("store"),
        lambda: rig.round("raw"),
        baseline_name=f"raw TCP, {CLIENTS} connections",
        nbytes=2 * CLIENTS * REQUESTS * REQUEST_BYTES,
        rounds=5,
        warmup=1,
    )
    store, raw = (np.array(rig.latency[k]) * 1e3 for k in ("store", "raw"))
    line = (
        f"4 MiB request latency, {block_kib} KiB blocks, {CLIENTS} clients: "
        f"p50 {np.percentile(store, 50):.1f} ms p99 {np.percentile(store, 99):.1f} ms  vs raw "
        f"p50 {np.percentile(raw, 50):.1f} ms p99 {np.percentile(raw, 99):.1f} ms"
    )
    _EXTRA_LINES.append(line)
    print(line)
