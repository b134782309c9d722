"""The store contract (``kvbridge.store.BlockStore``): one scenario, the same verbs and
argument names and lease type, run against each of the three stores: a local
``TieredStore``, a ``StoreClient`` of a real ``kvbridge serve`` and a ``ClusterClient`` of
two real members found in etcd. Each store is used through the contract only."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack

import numpy as np
import pytest
from etcd_support import ETCD_MISSING, EtcdProcess, until
from helpers import keys, payloads
from serve import ServeProcess

from kvbridge.store import (
    BlockNotFound,
    BlockPinned,
    BlockStore,
    ClusterClient,
    Lease,
    StoreClient,
    TieredStore,
)

BB = 4096


def _local(stack: ExitStack) -> BlockStore:
    return TieredStore(BB, host_capacity=64 * BB)


def _server(stack: ExitStack) -> BlockStore:
    server = ServeProcess("--host-capacity", "1MiB", "--handoff-ttl", "0")
    stack.callback(server.kill)
    return StoreClient(server.address, block_bytes=BB, namespace="contract")


def _cluster(stack: ExitStack) -> BlockStore:
    if ETCD_MISSING is not None:
        pytest.skip(ETCD_MISSING)
    etcd = stack.enter_context(EtcdProcess())
    for _ in range(2):
        member = ServeProcess(
            *("--cluster", etcd.url, "--cluster-name", "c", "--host-capacity", "1MiB"),
            *("--handoff-ttl", "0"),
        )
        stack.callback(member.kill)
    client = ClusterClient(etcd.url, block_bytes=BB, namespace="contract", cluster="c")
    until(lambda: len(client.members()) == 2)
    return client


STORES: dict[str, Callable[[ExitStack], BlockStore]] = {
    "local": _local,
    "server": _server,
    "cluster": pytest.param(_cluster, marks=pytest.mark.slow),  # type: ignore[dict-item]
}


@pytest.fixture(params=list(STORES.values()), ids=list(STORES))
def store(request: pytest.FixtureRequest) -> Iterator[BlockStore]:
    with ExitStack() as stack:
        made = request.param(stack)
        with made:
            yield made


def test_every_store_is_a_block_store(store: BlockStore) -> None:
    assert isinstance(store, BlockStore)
    assert store.block_bytes == BB


def test_put_get_match_and_remove_mean_the_same_everywhere(store: BlockStore) -> None:
    ks = keys(0, 6)
    assert store.put(ks[:4], payloads(ks[:4], BB)) == [True] * 4
    assert store.put(ks, payloads(ks, BB)) == [False] * 4 + [True] * 2  # dedup
    assert store.contains([*ks[:2], *keys(50, 51)]) == [True, True, False]
    assert store.match_prefix([*ks[:3], *keys(50, 51), *ks[3:]]) == 3
    out = np.zeros((6, BB), np.uint8)
    store.get(ks, out)
    np.testing.assert_array_equal(out, payloads(ks, BB))
    with pytest.raises(BlockNotFound) as missing:
        store.get([ks[0], *keys(50, 52)], np.zeros((3, BB), np.uint8))
    assert set(missing.value.keys) == set(keys(50, 52))  # every absent key named
    assert store.remove([ks[5], *keys(50, 51)]) == [True, False]
    assert store.contains(ks[5:]) == [False]


def test_a_pin_is_a_lease_that_keeps_its_blocks(store: BlockStore) -> None:
    ks = keys(0, 4)
    store.put(ks, payloads(ks, BB))
    with pytest.raises(BlockNotFound):
        store.pin([*ks[:1], *keys(50, 51)])  # all or nothing
    lease = store.pin(ks[:2])
    assert isinstance(lease, Lease) and not lease.expired
    with pytest.raises(BlockPinned):
        store.remove(ks[:1])
    assert store.clear() >= 2  # every block no lease pins (a cluster counts each copy)
    assert store.contains(ks) == [True, True, False, False]
    with lease:  # a lease is released by its with block, or by release()
        pass
    assert lease.released
    lease.release()  # twice is harmless
    assert store.clear() >= 2 and store.contains(ks) == [False] * 4
