"""``put_pages`` / ``get_pages`` (and ``put_from`` / ``get_into``) check every offset before
a byte moves: an offset near 2**63 must not wrap around the bounds check, so a call of many
requests is refused whole with ``InvalidBlock`` and moves nothing, rather than moving the
requests before the bad one and failing in the transfer layer."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from helpers import keys, payloads

from kvbridge.store import CacheServer, InvalidBlock, ServerConfig, StoreClient

PAGE = 4096
LAYERS = 2
BLOCKS = 20
SLOTS = 16
"""The namespace's memory slots: a request covers at most a quarter (4 blocks), so 20
blocks take 5 requests and the bad page is in the last."""

_HUGE = (2**63 - 1, 2**63 - PAGE, 2**63 - 1 - (BLOCKS * PAGE) // 2, 2**64 - 1)


@pytest.fixture
def client() -> Iterator[StoreClient]:
    config = ServerConfig(port=0, host_capacity=SLOTS * PAGE * LAYERS, max_namespaces=1)
    with (
        CacheServer(config) as server,
        StoreClient(server.address, block_bytes=PAGE * LAYERS, namespace="pages") as client,
    ):
        assert client.request_keys == SLOTS // 4
        yield client


def _pages(fill: int) -> list[np.ndarray]:
    return [np.full(BLOCKS * PAGE, fill + layer, np.uint8) for layer in range(LAYERS)]


def _offsets(bad: int, block: int = 16) -> np.ndarray:
    offsets = np.arange(BLOCKS, dtype=np.uint64)[:, None] * np.uint64(PAGE)
    offsets = np.repeat(offsets, LAYERS, axis=1)
    offsets[block, 1] = np.uint64(bad)
    return offsets


@pytest.mark.parametrize("bad", _HUGE)
def test_a_huge_page_offset_in_a_put_stores_nothing(client: StoreClient, bad: int) -> None:
    pages = _pages(1)
    regions = [client.register(page) for page in pages]
    ks = keys(0, BLOCKS)
    with pytest.raises(InvalidBlock, match="outside its region"):
        client.put_pages(ks, regions, _offsets(bad))
    assert client.contains(ks) == [False] * BLOCKS
    assert client.match_prefix(ks) == 0


@pytest.mark.parametrize("bad", _HUGE)
def test_a_huge_page_offset_in_a_get_writes_no_page(client: StoreClient, bad: int) -> None:
    ks = keys(0, BLOCKS)
    for start in range(0, BLOCKS, 4):  # stored a request's worth at a time
        client.put(ks[start : start + 4], payloads(ks[start : start + 4], PAGE * LAYERS))
    pages = _pages(7)
    regions = [client.register(page) for page in pages]
    with pytest.raises(InvalidBlock, match="outside its region"):
        client.get_pages(ks, regions, _offsets(bad))
    for layer, page in enumerate(pages):
        assert (page == 7 + layer).all()  # not one page landed


@pytest.mark.parametrize("bad", [2**63 - 1, 2**64 - 1, 2**70, -1, 2.5])
def test_put_from_and_get_into_refuse_offsets_that_are_not_in_the_region(
    client: StoreClient, bad: object
) -> None:
    memory = np.zeros(BLOCKS * PAGE * LAYERS, np.uint8)
    region = client.register(memory)
    ks = keys(0, 4)
    offsets: list[object] = [0, PAGE * LAYERS, 2 * PAGE * LAYERS, bad]
    with pytest.raises(InvalidBlock):
        client.put_from(ks, region, offsets)  # type: ignore[arg-type]
    assert client.contains(ks) == [False] * 4
    with pytest.raises(InvalidBlock):
        client.get_into(ks, region, offsets)  # type: ignore[arg-type]
