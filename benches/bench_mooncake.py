"""Mooncake's TCP transport on the same job as bench_transfer.py, when it is installed.

``pip install mooncake-transfer-engine-non-cuda`` (needs Debian's ``libibverbs1`` even for
TCP). 256 MiB per round as 1 MiB, 64 KiB, 16 KiB and 4 KiB ops in shuffled order, batches
of 128 ops (how Mooncake is usually driven), write; baseline: kvbridge's TCP engine moving
the same ops in the same process run, so the ratio is Mooncake against kvbridge.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _transfer_target import TOTAL, read_ready, shuffled_offsets
from conftest import _EXTRA_LINES

from kvbridge.transfer import OP_DTYPE, TransferEngine

mooncake = pytest.importorskip(
    "mooncake.engine", reason="mooncake-transfer-engine-non-cuda is not installed"
)
BATCH = 128


@pytest.fixture(scope="module")
def mooncake_target() -> Iterator[tuple[str, int]]:
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "_mooncake_target.py")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    session, address = proc.stdout.readline().split()
    yield session, int(address)
    proc.stdin.close()
    proc.wait(30)


@pytest.fixture(scope="module")
def kvbridge_target() -> Iterator[bytes]:
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "_transfer_target.py"), "2"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    metadata_hex, _ = read_ready(proc.stdout)
    yield bytes.fromhex(metadata_hex)
    proc.stdin.close()
    proc.wait(30)


@pytest.mark.parametrize(
    "block", [1 << 20, 64 << 10, 16 << 10, 4 << 10], ids=["1MiB", "64KiB", "16KiB", "4KiB"]
)
def test_mooncake_tcp_write(
    compare: Callable[..., Any],
    mooncake_target: tuple[str, int],
    kvbridge_target: bytes,
    block: int,
) -> None:
    session, remote_base = mooncake_target
    local = np.random.default_rng(0).integers(0, 256, TOTAL, dtype=np.uint8)
    count = TOTAL // block
    local_offsets = shuffled_offsets(block, count, block + 1)
    remote_offsets = shuffled_offsets(block, count, block)

    engine = mooncake.TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert engine.register_memory(local.ctypes.data, TOTAL) == 0
    sources = (local.ctypes.data + local_offsets).tolist()
    targets = (remote_base + remote_offsets).tolist()
    lengths = [block] * BATCH

    def run_mooncake() -> None:
        for i in range(0, count, BATCH):
            status = engine.batch_transfer_sync_write(
                session, sources[i : i + BATCH], targets[i : i + BATCH], lengths
            )
            assert status == 0, status

    with TransferEngine("bench", streams=2) as ours:
        region = ours.register(local)
        peer = ours.connect(kvbridge_target)
        remote = next(iter(peer.regions.values())).id
        ops = np.zeros(count, OP_DTYPE)
        ops["local_region"], ops["remote_region"] = region.id, remote
        ops["local_offset"], ops["remote_offset"], ops["length"] = (
            local_offsets,
            remote_offsets,
            block,
        )
        batches = [ops[i : i + BATCH] for i in range(0, count, BATCH)]

        def run_kvbridge() -> None:
            for handle in [peer.write(batch) for batch in batches]:
                handle.wait(120)

        compare(
            f"mooncake tcp write {block >> 10} KiB, batches of {BATCH}",
            run_mooncake,
            run_kvbridge,
            baseline_name="kvbridge tcp, same ops",
            nbytes=TOTAL,
            rounds=3,
            warmup=1,
        )
    engine.unregister_memory(local.ctypes.data)


@pytest.mark.parametrize("block", [8 << 10, 64 << 10], ids=["8KiB", "64KiB"])
def test_one_op_latency_against_mooncake(
    mooncake_target: tuple[str, int], kvbridge_target: bytes, block: int
) -> None:
    """One write in flight at a time: Mooncake's ``transfer_sync_write`` against kvbridge's
    ``write(...).wait()`` of the same block, 1,000 each, alternated in rounds of 100."""
    session, remote_base = mooncake_target
    local = np.random.default_rng(0).integers(0, 256, TOTAL, dtype=np.uint8)
    engine = mooncake.TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert engine.register_memory(local.ctypes.data, TOTAL) == 0
    theirs: list[float] = []
    ours: list[float] = []
    with TransferEngine("bench", streams=2) as kvb:
        region = kvb.register(local)
        peer = kvb.connect(kvbridge_target)
        ops = np.zeros(1, OP_DTYPE)
        ops["local_region"], ops["remote_region"] = region.id, next(iter(peer.regions))
        ops["length"] = block
        for _ in range(50):  # warm-up, both
            assert engine.transfer_sync_write(session, local.ctypes.data, remote_base, block) == 0
            peer.write(ops).wait(10)
        for _ in range(10):
            for _ in range(100):
                start = time.perf_counter()
                status = engine.transfer_sync_write(session, local.ctypes.data, remote_base, block)
                theirs.append(time.perf_counter() - start)
                assert status == 0
            for _ in range(100):
                start = time.perf_counter()
                peer.write(ops).wait(10)
                ours.append(time.perf_counter() - start)
    engine.unregister_memory(local.ctypes.data)
    a, b = np.array(ours) * 1e6, np.array(theirs) * 1e6
    line = (
        f"one {block >> 10} KiB write: kvbridge p50 {np.percentile(a, 50):.0f} us p99 "
        f"{np.percentile(a, 99):.0f} us, Mooncake transfer_sync_write p50 "
        f"{np.percentile(b, 50):.0f} us p99 {np.percentile(b, 99):.0f} us "
        f"(ratio of p50s {np.percentile(b, 50) / np.percentile(a, 50):.2f})"
    )
    _EXTRA_LINES.append(line)
    print(line)
