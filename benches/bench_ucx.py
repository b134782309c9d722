"""UCX transport against raw ucxx and against kvbridge's TCP transport, two processes.

Cases per op size (1 MiB, 64 KiB, 16 KiB, 4 KiB; 256 MiB per round in shuffled order):
kvbridge-ucx over shared memory (UCX_TLS=posix,sysv,self, the default on one host),
kvbridge-ucx over TCP (UCX_TLS=tcp,self), each against raw ucxx tag messages of the same
blocks (one message per block, posted all at once, driven by the same blocking progress
thread kvbridge uses), plus kvbridge-tcp against the same raw ucxx figure for reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _transfer_target import TOTAL, shuffled_offsets
from _ucx_target import ACK_TAG, START, START_TAG

from kvbridge.transfer import OP_DTYPE, TransferEngine, ucx_available

pytestmark = pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed")
HERE = Path(__file__).parent
TLS = {"sm": "posix,sysv,self", "tcp": "tcp,self"}
SIZES = [1 << 20, 64 << 10, 16 << 10, 4 << 10]


class _Side:
    """Our end: a kvbridge engine connected to the target, and a raw ucxx worker."""

    def __init__(self, mode: str) -> None:
        from kvbridge.transfer._ucx import _Worker  # noqa: PLC0415

        env = {**os.environ, "UCX_TLS": TLS[mode]}
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "_ucx_target.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        metadata_hex, raw_hex = self.proc.stdout.readline().split()
        saved = os.environ.get("UCX_TLS")
        os.environ["UCX_TLS"] = TLS[mode]
        try:
            self.raw = _Worker()
            self.engine = TransferEngine(f"bench-{mode}", transports="ucx")
        finally:
            if saved is None:
                del os.environ["UCX_TLS"]
            else:
                os.environ["UCX_TLS"] = saved
        self.proc.stdin.write(self.raw.address.hex() + "\n")
        self.proc.stdin.flush()
        ucx = self.raw.ucx
        address = ucx.UCXAddress.create_from_buffer(bytes.fromhex(raw_hex))
        holder: list[Any] = []

        def connect() -> Any:
            holder.append(
                ucx.UCXEndpoint.create_from_worker_address(self.raw.worker, address, False)
            )
            return [], None

        self.raw.call(connect).result(10)
        self.endpoint = holder[0]
        self.local = np.random.default_rng(0).integers(0, 256, TOTAL, dtype=np.uint8)
        self.region = self.engine.register(self.local)
        self.peer = self.engine.connect(bytes.fromhex(metadata_hex))
        self.remote = next(iter(self.peer.regions.values())).id

    def raw_round(self, block: int, seed: int) -> Callable[[], None]:
        count = TOTAL // block
        offsets = shuffled_offsets(block, count, seed + 1).tolist()
        views = [self.local.data[o : o + block] for o in offsets]
        start = START.pack(block, count, seed)
        ack = bytearray(1)
        ucx, array, ep, worker = self.raw.ucx, self.raw.Array, self.endpoint, self.raw.worker

        def post() -> Any:
            requests = [ep.tag_send(array(start), ucx.UCXXTag(START_TAG))]
            requests += [ep.tag_send(array(v), ucx.UCXXTag(i)) for i, v in enumerate(views)]
            requests.append(worker.tag_recv(array(ack), ucx.UCXXTag(ACK_TAG)))
            return requests, None

        return lambda: self.raw.call(post).result(120)

    def batches(self, block: int, seed: int) -> list[np.ndarray]:
        count = TOTAL // block
        ops = np.zeros(count, OP_DTYPE)
        ops["local_region"], ops["remote_region"] = self.region.id, self.remote
        ops["local_offset"] = shuffled_offsets(block, count, seed + 1)
        ops["remote_offset"] = shuffled_offsets(block, count, seed)
        ops["length"] = block
        return [ops[i : i + 4096] for i in range(0, count, 4096)]

    def close(self) -> None:
        self.engine.close()
        endpoint = self.endpoint
        self.raw.call(lambda: ([], endpoint.close()))
        self.raw.close()
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


@pytest.fixture(scope="module", params=["sm", "tcp"])
def side(request: pytest.FixtureRequest) -> Iterator[_Side]:
    s = _Side(str(request.param))
    s.mode = str(request.param)  # type: ignore[attr-defined]
    yield s
    s.close()


@pytest.mark.parametrize("block", SIZES, ids=["1MiB", "64KiB", "16KiB", "4KiB"])
@pytest.mark.parametrize("op", ["write", "read"])
def test_ucx_throughput(compare: Callable[..., Any], side: _Side, block: int, op: str) -> None:
    batches = side.batches(block, seed=block)
    submit = side.peer.write if op == "write" else side.peer.read

    def subject() -> None:
        for handle in [submit(b) for b in batches]:
            handle.wait(120)

    compare(
        f"ucx/{side.mode} {op} {block >> 10} KiB ops",  # type: ignore[attr-defined]
        subject,
        side.raw_round(block, seed=block),
        baseline_name=f"raw ucxx tag messages, {side.mode}",  # type: ignore[attr-defined]
        nbytes=TOTAL,
        rounds=3,
        warmup=1,
    )
