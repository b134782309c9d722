"""kvbridge's cache server against Mooncake's store on the same job, same run, when
``mooncake-transfer-engine-non-cuda`` is installed (it ships ``mooncake_master`` and the
Python store client; needs Debian's ``libibverbs1`` even for TCP).

Both are driven the zero-copy way: 512 blocks of one size (64 KiB to 2 MiB) per round, in
batches of 64, from and into one registered buffer of the bench process. kvbridge:
``StoreClient.put_from`` / ``get_into`` against one ``kvbridge serve`` holding the memory.
Mooncake: ``batch_put_from`` / ``batch_get_into`` of a ``MooncakeDistributedStore`` that
contributes no segment, against a ``mooncake_master`` and a second store process that
contributes the memory (TCP, P2P handshake). Both stores are emptied before each put round
(untimed), so every put writes every block; gets read the last round's blocks. Baseline:
Mooncake, so a ratio above 1 means kvbridge is faster.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from serve import ServeProcess

from kvbridge.store import StoreClient

store_api = pytest.importorskip(
    "mooncake.store", reason="mooncake-transfer-engine-non-cuda is not installed"
)
HERE = Path(__file__).parent
BLOCKS, BATCH = 512, 64
SIZES = [64 << 10, 256 << 10, 1 << 20, 2 << 20]
SEGMENT = 2 << 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def mooncake() -> Iterator[Any]:
    port = _free_port()
    master_bin = Path(sys.executable).parent / "mooncake_master"
    master = subprocess.Popen(
        [str(master_bin), f"--rpc_port={port}", "--rpc_address=127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    holder = subprocess.Popen(
        [
            sys.executable,
            str(HERE / "_mooncake_store_holder.py"),
            f"127.0.0.1:{port}",
            str(SEGMENT),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        client = store_api.MooncakeDistributedStore()
        if client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", f"127.0.0.1:{port}"):
            pytest.fail("mooncake client setup failed")
        yield client
        client.close()
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)
        master.terminate()
        master.wait(30)


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    proc = ServeProcess("--host-capacity", "6GiB", "--max-namespaces", "4", "--handoff-ttl", "0")
    yield proc
    proc.kill()


@pytest.mark.parametrize("size", SIZES, ids=[f"{s >> 10}KiB" for s in SIZES])
@pytest.mark.parametrize("direction", ["put", "get"])
def test_store_against_mooncake(
    compare: Callable[..., Any], server: ServeProcess, mooncake: Any, size: int, direction: str
) -> None:
    data = np.random.default_rng(size).integers(0, 256, BLOCKS * size, dtype=np.uint8)
    out = np.zeros_like(data)
    base, into = data.ctypes.data, out.ctypes.data
    if mooncake.register_buffer(base, data.nbytes) or mooncake.register_buffer(into, out.nbytes):
        pytest.fail("mooncake register_buffer failed")
    names = [f"b{size}-{i}" for i in range(BLOCKS)]
    keys = [name.encode().ljust(32, b"\0") for name in names]
    offsets = [i * size for i in range(BLOCKS)]
    batches = range(0, BLOCKS, BATCH)
    with StoreClient(server.address, block_bytes=size, namespace=f"ns{size}") as client:
        source, target = client.register(data, access="r"), client.register(out)

        def kv_put() -> None:
            for i in batches:
                client.put_from(keys[i : i + BATCH], source, offsets[i : i + BATCH])

        def kv_get() -> None:
            for i in batches:
                client.get_into(keys[i : i + BATCH], target, offsets[i : i + BATCH])

        def mc_put() -> None:
            for i in batches:
                part, at = names[i : i + BATCH], offsets[i : i + BATCH]
                codes = mooncake.batch_put_from(part, [base + o for o in at], [size] * len(part))
                if any(code != 0 for code in codes):
                    pytest.fail(f"mooncake batch_put_from: {codes[:4]}")

        def mc_get() -> None:
            for i in batches:
                part, at = names[i : i + BATCH], offsets[i : i + BATCH]
                got = mooncake.batch_get_into(part, [into + o for o in at], [size] * len(part))
                if any(n != size for n in got):
                    pytest.fail(f"mooncake batch_get_into: {got[:4]}")

        def empty_both() -> None:  # untimed: after each Mooncake round, before each of ours
            client.clear()
            mooncake.remove_all(True)

        empty_both()
        kv_put()
        mc_put()
        if direction == "put":
            empty_both()
        compare(
            f"{direction} {BLOCKS} x {size >> 10} KiB, batches of {BATCH}",
            kv_put if direction == "put" else kv_get,
            mc_put if direction == "put" else mc_get,
            baseline_name="Mooncake store",
            nbytes=BLOCKS * size,
            rounds=10,
            warmup=0,
            setup=empty_both if direction == "put" else None,
        )
        if direction == "get":
            assert np.array_equal(out, data)
        mooncake.unregister_buffer(base)
        mooncake.unregister_buffer(into)
