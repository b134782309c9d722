"""The connector core's page-wise loads and saves against the server's plain ``get_into``
and ``put_from`` of the same bytes (goal: at least 0.8x). A block is 1 MiB: 8 layer pages
of 128 KiB, as vLLM's CPU cache lays out a model with 8 KV heads of 64 and 32-token blocks,
or 32 pages of 32 KiB, an engine's page (Llama-3-8B's K or V of a 16-token block is
32 KiB): the connector moves 8 or 32 ops per block, the baseline one contiguous 1 MiB op."""

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

BLOCKS = 16
SHAPES = [(8, 128 << 10), (32, 32 << 10)]
"""(layers, page bytes): 1 MiB blocks either way."""


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    proc = ServeProcess("--host-capacity", "512MiB", "--handoff-ttl", "0")
    yield proc
    proc.kill()


@pytest.fixture(params=SHAPES, ids=[f"{page >> 10}KiB" for _, page in SHAPES])
def shape(request: pytest.FixtureRequest) -> tuple[int, int]:
    layers, page = request.param
    return int(layers), int(page)


def _identity(extra: str, layers: int, page: int) -> Identity:
    return Identity("bench", "m", "float32", f"cpu/{layers}", 32, layers * page, "tp0/1", extra)


def _cache(layers: int, page: int) -> PagedKV:
    rng = [np.random.default_rng(i) for i in range(layers)]
    return PagedKV(tuple(r.integers(0, 256, (64, page), np.uint8) for r in rng), "bench")


def test_connector_load(
    compare: Callable[..., Any], server: ServeProcess, shape: tuple[int, int]
) -> None:
    layers, page = shape
    kv = _cache(layers, page)
    ids = list(range(3, 3 + BLOCKS))
    config = ConnectorConfig(server=server.address)
    with (
        ConnectorCore(config, _identity(f"load-{page}", layers, page), saves=True) as core,
        StoreClient(server.address, block_bytes=layers * page, namespace=f"plain-{page}") as plain,
    ):
        core.attach(kv)
        keys = core.keys(list(range(32 * BLOCKS)))
        core.save_later([SaveJob("r", tuple(keys), tuple(ids))])
        assert core.flush(["r"])
        flat = np.empty((BLOCKS, layers * page), np.uint8)
        region = plain.register(flat)
        plain_keys = prefix_hashes(range(32 * BLOCKS), 32, namespace=f"plain-{page}".encode())
        plain.put(plain_keys, kv.gather(ids))
        offsets = [i * layers * page for i in range(BLOCKS)]
        compare(
            f"connector load, {BLOCKS} blocks of {layers} x {page >> 10} KiB",
            lambda: core.load(keys, ids) or pytest.fail("load failed"),
            lambda: plain.get_into(plain_keys, region, offsets),
            baseline_name="StoreClient.get_into, 1 MiB blocks",
            nbytes=BLOCKS * layers * page,
        )
        assert np.array_equal(flat, kv.gather(ids))


def test_connector_save(
    compare: Callable[..., Any], server: ServeProcess, shape: tuple[int, int]
) -> None:
    layers, page = shape
    kv = _cache(layers, page)
    ids = tuple(range(BLOCKS))
    rounds = itertools.count()
    config = ConnectorConfig(server=server.address)
    with (
        ConnectorCore(config, _identity(f"save-{page}", layers, page), saves=True) as core,
        StoreClient(
            server.address, block_bytes=layers * page, namespace=f"plain-save-{page}"
        ) as plain,
    ):
        core.attach(kv)
        flat = kv.gather(list(ids))
        region = plain.register(flat)
        offsets = [i * layers * page for i in range(BLOCKS)]

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
            f"connector save, {BLOCKS} blocks of {layers} x {page >> 10} KiB",
            save,
            put,
            baseline_name="StoreClient.put_from, 1 MiB blocks",
            nbytes=BLOCKS * layers * page,
            rounds=10,
        )


@pytest.mark.parametrize("direction", ["load", "save"])
def test_connector_staged(
    compare: Callable[..., Any], server: ServeProcess, direction: str, shape: tuple[int, int]
) -> None:
    """The staged path (``staging: "always"``, the GPU path's logic on host memory) against
    the direct path of the same blocks: what staging costs on the CPU (goal: >= 0.8x)."""
    layers, page = shape
    kv = _cache(layers, page)
    ids = tuple(range(BLOCKS))
    staged = ConnectorConfig.from_extra({"server": server.address, "staging": "always"})
    direct = ConnectorConfig(server=server.address)
    rounds = itertools.count()
    with (
        ConnectorCore(staged, _identity(f"staged-{direction}-{page}", layers, page)) as through,
        ConnectorCore(direct, _identity(f"direct-{direction}-{page}", layers, page)) as straight,
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
            f"connector {direction}, staged, {BLOCKS} x {layers} x {page >> 10} KiB",
            move(through, keys),
            move(straight, other),
            baseline_name="the same, direct",
            nbytes=BLOCKS * layers * page,
            rounds=10,
        )
