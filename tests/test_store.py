"""TieredStore: the put/get/match/contains/remove surface and its typed errors."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from helpers import key, keys, payload, payloads

from kvbridge.store import (
    BlockNotFound,
    BlockPinned,
    InvalidBlock,
    InvalidKey,
    StoreClosed,
    StoreFull,
    TieredStore,
)

BB = 256


@pytest.fixture
def store() -> Iterator[TieredStore]:
    with TieredStore(BB, host_capacity=16 * BB) as s:
        yield s


def _snapshot(store: TieredStore) -> tuple[object, ...]:
    stats = store.stats()
    return (
        [(t.name, t.blocks) for t in stats.tiers],
        [sorted(t.keys()) for t in store.tiers],
        stats.puts,
    )


def test_put_then_get_contiguous_and_per_block_forms(store: TieredStore) -> None:
    ks = keys(0, 4)
    data = payloads(ks, BB)
    assert store.put(ks, data) == [True] * 4
    out = np.zeros_like(data)
    store.get(ks, out)
    np.testing.assert_array_equal(out, data)

    more = keys(4, 7)
    as_list = [payload(k, BB).tobytes() for k in more]  # bytes
    assert store.put(more, as_list) == [True] * 3
    outs: list[bytearray | npt.NDArray[np.uint8] | memoryview] = [
        bytearray(BB),
        np.zeros(BB, np.uint8),
        memoryview(bytearray(BB)),
    ]
    store.get(more, outs)
    for k, o in zip(more, outs, strict=True):
        assert bytes(o) == payload(k, BB).tobytes()


def test_any_buffer_layout_with_the_right_size(store: TieredStore) -> None:
    ks = keys(0, 2)
    as_float = payloads(ks, BB).view(np.float32)  # (2, 64) float32: 512 bytes
    store.put(ks, as_float)
    out = memoryview(bytearray(2 * BB))
    store.get(ks, out)
    assert bytes(out) == payloads(ks, BB).tobytes()


def test_duplicates_are_not_stored_again(store: TieredStore) -> None:
    ks = keys(0, 3)
    assert store.put(ks, payloads(ks, BB)) == [True, True, True]
    again = [ks[1], key(99), key(99), ks[0]]
    assert store.put(again, payloads(again, BB)) == [False, True, False, False]
    stats = store.stats()
    assert stats.puts == 4
    assert stats.duplicates == 3
    assert stats.tiers[0].blocks == 4


def test_match_prefix_and_contains(store: TieredStore) -> None:
    ks = keys(0, 6)
    store.put(ks[:3], payloads(ks[:3], BB))
    store.put(ks[4:5], payloads(ks[4:5], BB))
    assert store.match_prefix(ks) == 3
    assert store.match_prefix(ks[3:]) == 0
    assert store.match_prefix([]) == 0
    assert store.contains(ks) == [True, True, True, False, True, False]


def test_match_prefix_has_no_side_effects(store: TieredStore) -> None:
    ks = keys(0, 3)
    store.put(ks, payloads(ks, BB))
    before = store.stats()
    order = list(store.tiers[0].policy.candidates())
    store.match_prefix(ks[::-1])
    store.contains(ks)
    assert store.stats() == before
    assert list(store.tiers[0].policy.candidates()) == order


def test_get_missing_names_keys_and_leaves_out_untouched(store: TieredStore) -> None:
    ks = keys(0, 3)
    store.put(ks[:2], payloads(ks[:2], BB))
    out = np.full((3, BB), 7, np.uint8)
    with pytest.raises(BlockNotFound) as info:
        store.get([ks[0], ks[2], ks[1]], out)
    assert info.value.keys == (ks[2],)
    assert (out == 7).all()
    assert store.stats().misses == 1


@pytest.mark.parametrize(
    ("ks", "blocks", "error"),
    [
        (keys(0, 2), np.zeros(BB * 3, np.uint8), InvalidBlock),  # wrong total size
        (keys(0, 2), [np.zeros(BB, np.uint8)], InvalidBlock),  # count mismatch
        (keys(0, 2), [np.zeros(BB, np.uint8), np.zeros(BB - 1, np.uint8)], InvalidBlock),
        (keys(0, 1), np.zeros((BB, 2), np.uint8)[:, 0], InvalidBlock),  # not contiguous
        (keys(0, 1), object(), InvalidBlock),  # no buffer protocol
        ([b"short"], np.zeros(BB, np.uint8), InvalidKey),
        (["x" * 32], np.zeros(BB, np.uint8), InvalidKey),
        ([key(0), 5], np.zeros(2 * BB, np.uint8), InvalidKey),
    ],
)
def test_bad_put_changes_nothing(
    store: TieredStore, ks: list[bytes], blocks: object, error: type[Exception]
) -> None:
    store.put(keys(10, 12), payloads(keys(10, 12), BB))
    before = _snapshot(store)
    with pytest.raises(error):
        store.put(ks, blocks)
    assert _snapshot(store) == before


def test_single_bytes_key_is_rejected(store: TieredStore) -> None:
    with pytest.raises(TypeError, match="sequence of keys"):
        store.put(key(0), np.zeros(BB, np.uint8))  # type: ignore[arg-type]


def test_get_into_read_only_or_wrong_size_out(store: TieredStore) -> None:
    ks = keys(0, 2)
    store.put(ks, payloads(ks, BB))
    with pytest.raises(InvalidBlock, match="read-only"):
        store.get(ks, bytes(2 * BB))
    with pytest.raises(InvalidBlock):
        store.get(ks, np.zeros(BB, np.uint8))


def test_remove(store: TieredStore) -> None:
    ks = keys(0, 3)
    store.put(ks, payloads(ks, BB))
    assert store.remove([ks[0], key(50)]) == [True, False]
    assert store.contains(ks) == [False, True, True]
    with store.pin([ks[1]]), pytest.raises(BlockPinned):
        store.remove([ks[2], ks[1]])
    assert store.contains(ks) == [False, True, True]  # nothing removed
    assert store.remove([ks[1]]) == [True]  # lease released by the with block


def test_clear_removes_every_block_no_lease_pins(tmp_path: Path) -> None:
    with TieredStore(BB, host_capacity=4 * BB, disk_path=tmp_path, disk_capacity=16 * BB) as s:
        ks = keys(0, 10)  # 4 in memory, the rest demoted to disk
        s.put(ks, payloads(ks, BB))
        with s.pin([ks[9]]):
            assert s.clear() == 9
            assert s.contains(ks) == [False] * 9 + [True]
        assert s.stats().removed == 9
        assert s.clear() == 1
        assert s.match_prefix(ks) == 0
        s.put(ks[:2], payloads(ks[:2], BB))  # the store is usable after it
        assert s.contains(ks[:2]) == [True, True]


def test_pin_requires_present_keys(store: TieredStore) -> None:
    store.put(keys(0, 1), payloads(keys(0, 1), BB))
    with pytest.raises(BlockNotFound):
        store.pin([key(0), key(1)])
    store.remove([key(0)])  # the failed pin pinned nothing


def test_closed_store_refuses_everything() -> None:
    s = TieredStore(BB, host_capacity=4 * BB)
    s.close()
    s.close()  # idempotent
    for call in (
        lambda: s.put(keys(0, 1), np.zeros(BB, np.uint8)),
        lambda: s.get(keys(0, 1), np.zeros(BB, np.uint8)),
        lambda: s.match_prefix(keys(0, 1)),
        lambda: s.contains(keys(0, 1)),
        lambda: s.remove(keys(0, 1)),
        lambda: s.pin(keys(0, 1)),
    ):
        with pytest.raises(StoreClosed):
            call()


def test_stats_counts_and_bytes(store: TieredStore) -> None:
    ks = keys(0, 4)
    store.put(ks, payloads(ks, BB))
    store.get(ks[:2], np.zeros(2 * BB, np.uint8))
    stats = store.stats()
    assert (stats.puts, stats.hits, stats.misses) == (4, 2, 0)
    assert (stats.bytes_in, stats.bytes_out) == (4 * BB, 2 * BB)
    host = stats.tiers[0]
    assert (host.name, host.blocks, host.bytes, host.capacity_blocks) == ("host", 4, 4 * BB, 16)
    assert stats.as_dict()["tiers"][0]["capacity_bytes"] == 16 * BB


@pytest.mark.parametrize(
    "kwargs",
    [
        {"host_capacity": 0},
        {"host_capacity": BB - 1},
        {"host_capacity": "lots"},
        {"host_capacity": -1},
        {"host_capacity": BB, "disk_capacity": BB},  # capacity without a path
        {"host_capacity": BB, "policy": "random"},
        {"host_capacity": BB, "write_through": True},  # no disk tier
        {"host_capacity": BB, "pin_ttl": 0},
    ],
)
def test_bad_configuration_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        TieredStore(BB, **kwargs)  # type: ignore[arg-type]


def test_disk_path_needs_capacity(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="disk_capacity"):
        TieredStore(BB, host_capacity=BB, disk_path=tmp_path)


def test_human_readable_capacities() -> None:
    with TieredStore(4096, host_capacity="1MiB") as s:
        assert s.stats().tiers[0].capacity_blocks == 256


def test_store_full_when_everything_is_pinned(store: TieredStore) -> None:
    ks = keys(0, 16)
    store.put(ks, payloads(ks, BB))
    with store.pin(ks):
        before = _snapshot(store)
        with pytest.raises(StoreFull):
            store.put(keys(16, 17), payloads(keys(16, 17), BB))
        assert _snapshot(store) == before
    assert store.put(keys(16, 17), payloads(keys(16, 17), BB)) == [True]


def test_batch_larger_than_the_store_is_refused_whole(store: TieredStore) -> None:
    ks = keys(0, 17)
    with pytest.raises(StoreFull):
        store.put(ks, payloads(ks, BB))
    assert store.contains(ks) == [False] * 17


def test_concurrent_puts_and_gets_never_return_wrong_bytes() -> None:
    errors: list[BaseException] = []
    with TieredStore(BB, host_capacity=64 * BB) as s:

        def worker(seed: int) -> None:
            rng = np.random.default_rng(seed)
            try:
                for _ in range(300):
                    base = int(rng.integers(0, 200))
                    ks = keys(base, base + int(rng.integers(1, 8)))
                    s.put(ks, payloads(ks, BB))
                    out = np.zeros((len(ks), BB), np.uint8)
                    try:
                        s.get(ks, out)
                    except BlockNotFound:
                        continue  # evicted by another thread in between: a miss is fine
                    np.testing.assert_array_equal(out, payloads(ks, BB))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        stats = s.stats()
        assert stats.tiers[0].blocks <= 64
        assert stats.hits > 0
