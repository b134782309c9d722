"""TCP transfer engine against raw Python sockets, two processes on loopback.

256 MiB moved per round as 1 MiB, 64 KiB, 16 KiB and 4 KiB ops in shuffled order over a
256 MiB buffer (batches of up to 4,096 ops), write and read. Baseline: plain sockets with
``sendall`` of each block from one numpy buffer and ``recv_into`` another, at the same
stream count (one thread per stream on each side). Also: the latency of one 64 KiB write
against a raw ping-pong of the same size.
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _transfer_target import RAW_HEADER, TOTAL, read_ready, shuffled_offsets
from conftest import _EXTRA_LINES, _median_seconds

from kvbridge.transfer import OP_DTYPE, TransferEngine

STREAMS = 2
BATCH = 4096


@pytest.fixture(scope="module")
def target() -> Iterator[tuple[bytes, int]]:
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "_transfer_target.py"), str(STREAMS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    metadata_hex, port = read_ready(proc.stdout)
    yield bytes.fromhex(metadata_hex), int(port)
    proc.stdin.close()
    proc.wait(30)


@pytest.fixture(scope="module")
def engine(target: tuple[bytes, int]) -> Iterator[tuple[TransferEngine, Any, int, np.ndarray]]:
    with TransferEngine("bench", streams=STREAMS) as eng:
        local = np.random.default_rng(0).integers(0, 256, TOTAL, dtype=np.uint8)
        region = eng.register(local)
        peer = eng.connect(target[0])
        remote = next(iter(peer.regions.values())).id
        yield eng, (peer, region), remote, local


def _raw_bulk(port: int, block: int, seed: int, source: memoryview) -> Callable[[], None]:
    count = TOTAL // block
    offsets = shuffled_offsets(block, count, seed)
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(STREAMS)]
    for conn in conns:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def stream(i: int) -> None:
        conn = conns[i]
        conn.sendall(RAW_HEADER.pack(block, count, seed, i, STREAMS, 0))
        for offset in offsets[i::STREAMS].tolist():
            conn.sendall(source[offset : offset + block])
        conn.recv(1)

    def run() -> None:
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    run.conns = conns  # type: ignore[attr-defined]
    return run


def _batches(region_id: int, remote: int, block: int, seed: int) -> list[np.ndarray]:
    count = TOTAL // block
    ops = np.zeros(count, OP_DTYPE)
    ops["local_region"], ops["remote_region"] = region_id, remote
    ops["local_offset"] = shuffled_offsets(block, count, seed + 1)
    ops["remote_offset"] = shuffled_offsets(block, count, seed)
    ops["length"] = block
    return [ops[i : i + BATCH] for i in range(0, count, BATCH)]


@pytest.mark.parametrize(
    "block", [1 << 20, 64 << 10, 16 << 10, 4 << 10], ids=["1MiB", "64KiB", "16KiB", "4KiB"]
)
@pytest.mark.parametrize("op", ["write", "read"])
def test_tcp_throughput(
    compare: Callable[..., Any],
    target: tuple[bytes, int],
    engine: tuple[TransferEngine, Any, int, np.ndarray],
    block: int,
    op: str,
) -> None:
    _, (peer, region), remote, local = engine
    batches = _batches(region.id, remote, block, seed=block)
    submit = peer.write if op == "write" else peer.read

    def subject() -> None:
        for handle in [submit(batch) for batch in batches]:
            handle.wait(120)

    raw = _raw_bulk(target[1], block, seed=block, source=local.data)
    bulk = _raw_bulk(target[1], TOTAL // STREAMS, seed=block, source=local.data)
    try:
        result = compare(
            f"tcp {op} {block >> 10} KiB ops x {TOTAL // block}",
            subject,
            raw,
            baseline_name=f"raw sockets, {STREAMS} streams",
            nbytes=TOTAL,
            rounds=5,
            warmup=1,
        )
        bulk_s = _median_seconds(bulk, 5, None)
    finally:
        for conn in raw.conns + bulk.conns:  # type: ignore[attr-defined]
            conn.close()
    line = (
        f"tcp {op} {block >> 10} KiB ops: {TOTAL / result.subject_s / 1e9:.2f} GB/s vs raw bulk "
        f"({STREAMS} streams, one sendall of {TOTAL // STREAMS >> 20} MiB each) "
        f"{TOTAL / bulk_s / 1e9:.2f} GB/s, ratio {bulk_s / result.subject_s:.2f}"
    )
    _EXTRA_LINES.append(line)
    print(line)


@pytest.mark.parametrize("block", [8 << 10, 64 << 10], ids=["8KiB", "64KiB"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_latency_one_op(
    target: tuple[bytes, int],
    engine: tuple[TransferEngine, Any, int, np.ndarray],
    op: str,
    block: int,
) -> None:
    """One op in flight at a time, against a raw ping-pong carrying the block one way."""
    _, (peer, region), remote, local = engine
    rounds = 2000
    ops = np.zeros(1, OP_DTYPE)
    ops["local_region"], ops["remote_region"], ops["length"] = region.id, remote, block
    move = peer.write if op == "write" else peer.read
    for _ in range(50):
        move(ops).wait(10)
    ours = []
    for _ in range(rounds):
        start = time.perf_counter()
        move(ops).wait(10)
        ours.append(time.perf_counter() - start)
    conn = socket.create_connection(("127.0.0.1", target[1]))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.sendall(RAW_HEADER.pack(block, rounds, 7, 0, 1, 1))
    source = local.data[:block]
    raw = []
    for _ in range(rounds):
        start = time.perf_counter()
        conn.sendall(source)
        assert conn.recv(1) == b"k"
        raw.append(time.perf_counter() - start)
    conn.close()

    def pct(xs: list[float], p: float) -> float:
        return sorted(xs)[int(p * (len(xs) - 1))] * 1e6

    line = (
        f"{block >> 10} KiB {op} latency p50 {pct(ours, 0.5):.0f} us p99 {pct(ours, 0.99):.0f} us"
        f"  vs raw "
        f"ping-pong p50 {pct(raw, 0.5):.0f} us p99 {pct(raw, 0.99):.0f} us  "
        f"ratio(p50) {statistics.median(raw) / statistics.median(ours):.2f}"
    )
    print("\n" + line)
    _EXTRA_LINES.append(line)
