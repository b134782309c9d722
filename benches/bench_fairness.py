"""A client whose blocks are in memory, while another client pulls blocks from disk.

One ``kvbridge serve`` with 96 MiB of host memory and a disk tier holds 256 blocks of 1 MiB
on disk only (pushed, then pushed out of memory) and 2 hot blocks in memory. The measured
client reads its 2 hot blocks (``get_into`` a registered region) 100 times in a row: alone
(the baseline), then while a second client process pulls random requests of 8 disk blocks
in a loop. Reported: the median round time of both and their ratio (1.0 = the disk puller
costs the memory client nothing), and the per-read p50 and p99 of each.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import _EXTRA_LINES

from kvbridge.store import StoreClient
from kvbridge.tools._serve_cmds import read_listening

HERE = Path(__file__).parent
BB = 1 << 20
COLD = 256
READS = 100


class _Rig:
    def __init__(self, disk: str) -> None:
        self.server = subprocess.Popen(
            [
                *(sys.executable, "-m", "kvbridge", "serve", "--port", "0"),
                *("--host-capacity", "96MiB", "--max-namespaces", "1", "--handoff-ttl", "0"),
                *("--disk-path", disk, "--disk-capacity", "1GiB"),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.server.stdout is not None
        self.address, _ = read_listening(self.server.stdout)
        self.client = StoreClient(self.address, block_bytes=BB, namespace=b"bench")
        cold = [i.to_bytes(32, "little") for i in range(COLD)]
        data = np.random.default_rng(0).integers(0, 256, (COLD, BB), dtype=np.uint8)
        for start in range(0, COLD, 16):
            self.client.put(cold[start : start + 16], data[start : start + 16])
        self.hot = [(10**6 + i).to_bytes(32, "little") for i in range(2)]
        self.hot_data = data[:2].copy()
        self.client.put(self.hot, self.hot_data)
        self.out = np.zeros((2, BB), np.uint8)
        self.region = self.client.register(self.out.reshape(-1))
        self.puller = subprocess.Popen(
            [
                *(sys.executable, str(HERE / "_disk_puller.py"), self.address),
                *(str(BB), "0", str(COLD), "8", os.environ.get("KVB_PULL_PAUSE", "0.005")),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.puller.stdout is not None and self.puller.stdout.readline().strip() == "ready"
        self.reads: dict[str, list[float]] = {"alone": [], "beside": []}
        self.pulls = 0

    def _command(self, line: str) -> None:
        assert self.puller.stdin is not None
        self.puller.stdin.write(line + "\n")
        self.puller.stdin.flush()

    def reads_alone(self) -> None:
        self._read(self.reads["alone"])

    def reads_beside_disk(self) -> None:
        self._command("start")
        try:
            self._read(self.reads["beside"])
        finally:
            self._command("stop")
            assert self.puller.stdout is not None
            self.pulls = int(self.puller.stdout.readline())

    def _read(self, into: list[float]) -> None:
        for _ in range(READS):
            start = time.perf_counter()
            self.client.get_into(self.hot, self.region, [0, BB])
            into.append(time.perf_counter() - start)
        assert (self.out == self.hot_data).all()

    def close(self) -> None:
        assert self.puller.stdin is not None
        self.puller.stdin.close()
        self.puller.wait(30)
        self.client.close()
        self.server.terminate()
        self.server.wait(30)


@pytest.fixture(scope="module")
def rig() -> Iterator[_Rig]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVB_BENCH_DISK")) as disk:
        r = _Rig(disk)
        yield r
        r.close()


def test_memory_reads_beside_a_disk_puller(compare: Callable[..., Any], rig: _Rig) -> None:
    compare(
        f"{READS} memory reads of 2 MiB beside a disk puller",
        rig.reads_beside_disk,
        rig.reads_alone,
        baseline_name="the same reads alone",
        rounds=7,
        warmup=1,
    )
    alone, beside = (np.array(rig.reads[k]) * 1e3 for k in ("alone", "beside"))
    line = (
        f"2 MiB memory read beside a disk puller: p50 {np.percentile(beside, 50):.2f} ms "
        f"p99 {np.percentile(beside, 99):.2f} ms vs alone p50 {np.percentile(alone, 50):.2f} "
        f"ms p99 {np.percentile(alone, 99):.2f} ms (puller: {rig.pulls} requests in the last round)"
    )
    _EXTRA_LINES.append(line)
    print(line)
