"""What token ids cost a save (``docs/EVENTS.md``, "Token ids travel with saves"): puts of
512 blocks through a real ``kvbridge serve`` with each block's lineage (16 token ids and
its parent key), against the same puts without, in the same run, at 32 KiB and 4 KiB
blocks (the smaller the block, the larger the share of the per-block work)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from helpers import keys, payloads
from serve import ServeProcess

from kvbridge.store import BlockKey, Lineage, StoreClient

TOKENS = 16
BLOCKS = 512


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    served = ServeProcess("--host-capacity", "4GiB", "--handoff-ttl", "0")
    yield served
    served.kill()


@pytest.mark.parametrize("block_bytes", [32 << 10, 4 << 10])
def test_put_with_lineage(
    compare: Callable[..., Any], server: ServeProcess, block_bytes: int
) -> None:
    data = payloads(keys(0, BLOCKS), block_bytes)
    rounds = iter(range(1, 1_000_000))

    def client(namespace: str) -> StoreClient:
        return StoreClient(
            server.address,
            block_bytes=block_bytes,
            namespace=namespace,
            block_tokens=TOKENS,
        )

    with client(f"with-{block_bytes}") as tokens, client(f"without-{block_bytes}") as plain:

        def fresh() -> list[BlockKey]:
            base = next(rounds) * BLOCKS
            return keys(base, base + BLOCKS)

        def with_lineage() -> None:
            ks = fresh()
            parents: list[BlockKey | None] = [None, *ks[:-1]]
            lineage = [
                Lineage.of(up, range(n * TOKENS, (n + 1) * TOKENS)) for n, up in enumerate(parents)
            ]
            tokens.put(ks, data, lineage=lineage)

        compare(
            f"put of {BLOCKS} x {block_bytes >> 10} KiB blocks with lineage",
            with_lineage,
            lambda: plain.put(fresh(), data),
            baseline_name="the same put without",
            nbytes=BLOCKS * block_bytes,
            rounds=15,
        )
