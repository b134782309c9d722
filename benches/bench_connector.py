"""The connector core's page-wise loads and saves against the server's plain ``get_into``
and ``put_from`` of the same bytes (goal: at least 0.8x). A block is 8 layer pages of
128 KiB, as vLLM's CPU cache lays out a model with 8 KV heads of 64 and 32-token blocks:
the connector moves 8 ops per block, the baseline one contiguous 1 MiB op."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from serve import ServeProcess

from kvbridge.bindings import ConnectorConfig, ConnectorCore, Identity, PagedKV, SaveJob
from kvbridge.store import StoreClient, prefix_hashes

LAYERS, PAGE, BLOCKS = 8, 128 << 10, 16


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    proc = ServeProcess("--host-capacity", "512MiB", "--handoff-ttl", "0")
    yield proc
    proc.kill()


def _identity(extra: str) -> Identity:
    return Identity("bench", "m", "float32", "cpu/8x64", 32, LAYERS * PAGE, "tp0/1", extra)


def test_connector_load(compare: Callable[..., Any], server: ServeProcess) -> None:
    cache = [np.random.default_rng(i).integers(0, 256, (64, PAGE), np.uint8) for i in range(LAYERS)]
    kv = PagedKV(tuple(cache), "bench")
    ids = list(range(3, 3 + BLOCKS))
    config = ConnectorConfig(server=server.address)
    with (
        ConnectorCore(config, _identity("load"), saves=True) as core,
        StoreClient(server.address, block_bytes=LAYERS * PAGE, namespace="plain") as plain,
    ):
        core.attach(kv)
        keys = core.keys(list(range(32 * BLOCKS)))
        core.save_later([SaveJob("r", tuple(keys), tuple(ids))])
        assert core.flush(["r"])
        flat = np.empty((BLOCKS, LAYERS * PAGE), np.uint8)
        region = plain.register(flat)
        plain_keys = prefix_hashes(range(32 * BLOCKS), 32, namespace=b"plain")
        plain.put(plain_keys, kv.gather(ids))
        offsets = [i * LAYERS * PAGE for i in range(BLOCKS)]
        compare(
            f"connector load, {BLOCKS} blocks of {LAYERS} pages",
            lambda: core.load(keys, ids) or pytest.fail("load failed"),
            lambda: plain.get_into(plain_keys, region, offsets),
            baseline_name="StoreClient.get_into, 1 MiB blocks",
            nbytes=BLOCKS * LAYERS * PAGE,
        )
        assert np.array_equal(flat, kv.gather(ids))


def test_connector_save(compare: Callable[..., Any], server: ServeProcess) -> None:
    cache = [np.random.default_rng(i).integers(0, 256, (64, PAGE), np.uint8) for i in range(LAYERS)]
    kv = PagedKV(tuple(cache), "bench")
    ids = tuple(range(BLOCKS))
    rounds = itertools.count()
    config = ConnectorConfig(server=server.address)
    with (
        ConnectorCore(config, _identity("save"), saves=True) as core,
        StoreClient(server.address, block_bytes=LAYERS * PAGE, namespace="plain-save") as plain,
    ):
        core.attach(kv)
        flat = kv.gather(list(ids))
        region = plain.register(flat)
        offsets = [i * LAYERS * PAGE for i in range(BLOCKS)]

        def save() -> None:  # new keys each round: every block moves
            start = next(rounds) << 20
            keys = core.keys(list(range(start, start + 32 * BLOCKS)))
            core.save_later([SaveJob("s", tuple(keys), ids)])
            core.flush(["s"])

        def put() -> None:
            start = next(rounds) << 20
            keys = prefix_hashes(range(start, start + 32 * BLOCKS), 32)
            plain.put_from(keys, region, offsets)

        compare(
            f"connector save, {BLOCKS} blocks of {LAYERS} pages",
            save,
            put,
            baseline_name="StoreClient.put_from, 1 MiB blocks",
            nbytes=BLOCKS * LAYERS * PAGE,
            rounds=10,
        )


@pytest.mark.parametrize("direction", ["load", "save"])
def test_connector_staged(
    compare: Callable[..., Any], server: ServeProcess, direction: str
) -> None:
    """The staged path (``staging: "always"``, the GPU path's logic on host memory) against
    the direct path of the same blocks: what staging costs on the CPU (goal: >= 0.8x)."""
    cache = [np.random.default_rng(i).integers(0, 256, (64, PAGE), np.uint8) for i in range(LAYERS)]
    kv = PagedKV(tuple(cache), "bench")
    ids = tuple(range(BLOCKS))
    staged = ConnectorConfig.from_extra({"server": server.address, "staging": "always"})
    direct = ConnectorConfig(server=server.address)
    rounds = itertools.count()
    with (
        ConnectorCore(staged, _identity(f"staged-{direction}")) as through,
        ConnectorCore(direct, _identity(f"direct-{direction}")) as straight,
    ):
        through.attach(kv)
        straight.attach(kv)
        keys = through.keys(list(range(32 * BLOCKS)))
        other = straight.keys(list(range(32 * BLOCKS)))
        assert through.save(keys, ids) and straight.save(other, ids)

        def move(core: ConnectorCore, fixed: list[Any]) -> Callable[[], object]:
            if direction == "load":
                return lambda: core.load(fixed, ids) or pytest.fail("load failed")

            def save() -> None:  # new keys each round: every block moves
                start = next(rounds) << 20
                core.save(core.keys(list(range(start, start + 32 * BLOCKS))), ids)

            return save

        compare(
            f"connector {direction}, staged, {BLOCKS} blocks of {LAYERS} pages",
            move(through, keys),
            move(straight, other),
            baseline_name="the same, direct",
            nbytes=BLOCKS * LAYERS * PAGE,
            rounds=10,
        )
