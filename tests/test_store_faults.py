"""Faults as they happen: a disk that fills up (a small LMDB map, a tiny tmpfs), bytes
flipped in LMDB's data file (inside a payload and in LMDB's own page structures), a store
closed and reopened. Each failing operation must change nothing visible, lose no block that
was in the store before it, raise a typed error, and leave the store usable."""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from helpers import keys, payload, payloads

from kvbridge.store import BlockNotFound, StoreFull, TieredStore
from kvbridge.store._errors import StoreCorrupt
from kvbridge.store.local import RemoteAccess
from kvbridge.store.local.disk import _tier as disk_module

BB = 4096
TESTS = str(Path(__file__).parent)

# -- helpers -------------------------------------------------------------------------------


def _fill(store: TieredStore, slots: list[int | None], ks: Sequence[bytes]) -> None:
    """Write the payloads of a staged put into its top-tier slots, as a remote client would."""
    top = store.tiers[0]
    for slot, k in zip(slots, ks, strict=True):
        assert slot is not None
        top.memory.slot(slot)[:] = payload(k, store.block_bytes)  # type: ignore[attr-defined]


def _readable(store: TieredStore, ks: Sequence[bytes]) -> list[bool]:
    """Per key: whether ``get`` returns exactly its payload."""
    out = np.empty((1, store.block_bytes), np.uint8)
    result = []
    for k in ks:
        try:
            store.get([k], out)
        except BlockNotFound:
            result.append(False)
            continue
        assert (out[0] == payload(k, store.block_bytes)).all(), "wrong bytes returned"
        result.append(True)
    return result


def _pages(data_file: Path) -> Iterator[tuple[int, bytes]]:
    raw = data_file.read_bytes()
    for at in range(0, len(raw), 4096):
        yield at, raw[at : at + 4096]


_F_BIGDATA = 0x01
_P_LEAF = 0x02


def _node(data_file: Path, k: bytes, *, big: bool) -> tuple[int, int]:
    """Where ``k``'s node sits in a leaf page of LMDB's file: (page offset, key offset).

    ``big`` picks the node of the ``blocks`` database (its value lives in overflow pages,
    flag F_BIGDATA) over the one of ``sums`` (16 bytes inline). LMDB 0.9 layout: page header
    ``pgno u64, pad u16, flags u16``; node header ``lo u16, hi u16, flags u16, ksize u16``.
    """
    for page_at, page in _pages(data_file):
        flags = struct.unpack_from("<H", page, 10)[0]
        at = page.find(k)
        if not flags & _P_LEAF or at < 8:
            continue
        node_flags, ksize = struct.unpack_from("<HH", page, at - 4)
        if ksize == len(k) and bool(node_flags & _F_BIGDATA) == big:
            return page_at, page_at + at
    raise AssertionError("node not found")


def _patch(data_file: Path, at: int, data: bytes) -> None:
    with open(data_file, "r+b") as f:
        f.seek(at)
        f.write(data)


def _corrupt_payload(path: Path, k: bytes) -> None:
    """Flip bytes inside the stored payload of ``k`` (bit rot, a torn write): in the first
    overflow page its node points to, past the page header."""
    _, at = _node(path / "data.mdb", k, big=True)
    pgno = struct.unpack_from("<Q", (path / "data.mdb").read_bytes(), at + len(k))[0]
    _patch(path / "data.mdb", pgno * 4096 + 16 + 100, b"\xde\xad\xbe\xef")


# -- 3: a failing write-through in commit / put is all-or-nothing --------------------------


def test_commit_bigger_than_the_disk_stores_nothing_and_gives_its_slots_back(
    tmp_path: Path,
) -> None:
    with TieredStore(
        BB, host_capacity=8 * BB, disk_path=tmp_path, disk_capacity=2 * BB, write_through=True
    ) as store:
        remote = RemoteAccess(store)
        ks = keys(0, 4)
        lease, slots = remote.stage(ks)
        _fill(store, slots, ks)
        with pytest.raises(StoreFull):
            remote.commit(lease)
        assert store.contains(ks) == [False] * 4
        assert store.match_prefix(ks) == 0
        assert [t.blocks for t in store.stats().tiers] == [0, 0]
        # Every slot came back: the whole top tier can be staged again.
        again = keys(10, 18)
        lease, slots = remote.stage(again)
        assert None not in slots
        remote.abort(lease)
        ok = keys(20, 22)
        assert store.put(ok, payloads(ok, BB)) == [True, True]
        assert _readable(store, ok) == [True, True]


def _write(store: TieredStore, ks: Sequence[bytes], via: str) -> None:
    """Store ``ks`` with ``put``, or staged (as a cache server does) and committed."""
    if via == "put":
        store.put(ks, payloads(ks, BB))
        return
    lease, slots = RemoteAccess(store).stage(ks)
    _fill(store, slots, ks)
    RemoteAccess(store).commit(lease)


@pytest.mark.parametrize("via", ["put", "commit"])
def test_a_write_through_on_a_full_lmdb_map_stores_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, via: str
) -> None:
    # A map of 256 KiB (about 25 blocks of 4 KiB with LMDB's pages) runs out.
    monkeypatch.setattr(disk_module, "_map_size", lambda capacity, block_bytes: 256 << 10)
    with TieredStore(
        BB, host_capacity=64 * BB, disk_path=tmp_path, disk_capacity=64 * BB, write_through=True
    ) as store:
        remote = RemoteAccess(store)
        before = keys(0, 4)
        store.put(before, payloads(before, BB))
        ks = keys(100, 140)
        with pytest.raises(StoreFull):
            _write(store, ks, via)
        assert store.contains(ks) == [False] * len(ks)
        assert [t.blocks for t in store.stats().tiers] == [4, 4]
        assert _readable(store, before) == [True] * 4
        lease, _ = remote.stage(keys(200, 260))  # 60 of 64 slots: none leaked
        remote.abort(lease)
        small = keys(300, 302)
        _write(store, small, via)  # still usable
    with TieredStore(BB, host_capacity=0, disk_path=tmp_path, disk_capacity=64 * BB) as store:
        assert _readable(store, before + small) == [True] * 6
        assert store.contains(ks) == [False] * len(ks)


# -- 4: a failing pin_resident loses nothing ------------------------------------------------


def test_pin_resident_without_host_room_loses_no_block(tmp_path: Path) -> None:
    with TieredStore(BB, host_capacity=4 * BB, disk_path=tmp_path, disk_capacity=64 * BB) as s:
        old, new = keys(0, 4), keys(10, 14)
        s.put(old, payloads(old, BB))
        s.put(new, payloads(new, BB))  # old is demoted to disk
        with s.pin(new[:2]):  # two host slots cannot be freed
            with pytest.raises(StoreFull):
                RemoteAccess(s).pin_resident(old[:3])  # needs three
            assert s.stats().tiers[0].blocks == 4
            assert _readable(s, new) == [True] * 4
        assert s.remove(old + new) == [True] * 8  # nothing was left pinned
    with TieredStore(BB, host_capacity=4 * BB, disk_path=tmp_path, disk_capacity=64 * BB) as s:
        assert s.contains(old + new) == [False] * 8  # and the removal was committed


def test_pin_resident_keeps_what_it_demoted_when_a_later_block_is_corrupt(
    tmp_path: Path,
) -> None:
    opts: dict[str, object] = {"host_capacity": 4 * BB, "disk_capacity": 64 * BB}
    old = keys(0, 3)
    with TieredStore(BB, host_capacity=0, disk_path=tmp_path, disk_capacity=64 * BB) as s:
        s.put(old, payloads(old, BB))
    _corrupt_payload(tmp_path, old[1])
    with TieredStore(BB, disk_path=tmp_path, **opts) as s:  # type: ignore[arg-type]
        hot = keys(10, 14)
        s.put(hot, payloads(hot, BB))  # only in host memory
        with pytest.raises(BlockNotFound) as info:
            RemoteAccess(s).pin_resident(
                old
            )  # lifts old[0] (demoting a hot block), then finds old[1] bad
        assert info.value.keys == (old[1],)
        assert s.contains(old) == [True, False, True]
        assert s.match_prefix(old) == 1
        assert _readable(s, [*hot, old[0], old[2]]) == [True] * 6
        assert s.check().ok  # the bad block's removal stuck
        assert s.remove(hot + old) == [True, True, True, True, True, False, True]  # no pins


# -- 5: a block found bad is gone everywhere; a damaged page is a miss ----------------------


def test_a_block_found_bad_by_a_server_get_leaves_every_index(tmp_path: Path) -> None:
    ks = keys(0, 3)
    with TieredStore(BB, host_capacity=0, disk_path=tmp_path, disk_capacity=64 * BB) as s:
        s.put(ks, payloads(ks, BB))
    _corrupt_payload(tmp_path, ks[1])
    with TieredStore(BB, host_capacity=8 * BB, disk_path=tmp_path, disk_capacity=64 * BB) as s:
        with pytest.raises(BlockNotFound) as info:
            RemoteAccess(s).pin_resident(ks)
        assert info.value.keys == (ks[1],)
        assert s.contains(ks) == [True, False, True]
        assert s.match_prefix(ks) == 1
        assert s.stats().corrupt == 1
    with TieredStore(BB, host_capacity=0, disk_path=tmp_path, disk_capacity=64 * BB) as s:
        assert s.contains(ks) == [True, False, True]  # gone from the file too
        assert s.check().ok


def _damaged_store(path: Path, ks: Sequence[bytes]) -> Path:
    with TieredStore(BB, host_capacity=0, disk_path=path, disk_capacity=64 * BB) as s:
        s.put(ks, payloads(ks, BB))
    return path / "data.mdb"


def test_a_damaged_overflow_pointer_is_a_miss(tmp_path: Path) -> None:
    ks = keys(0, 6)
    data_file = _damaged_store(tmp_path, ks)
    _, at = _node(data_file, ks[2], big=True)
    _patch(data_file, at + len(ks[2]), struct.pack("<Q", 10**9))  # page number past the end
    with TieredStore(BB, host_capacity=0, disk_path=tmp_path, disk_capacity=64 * BB) as s:
        assert _readable(s, ks) == [True, True, False, True, True, True]
        assert s.contains(ks) == [True, True, False, True, True, True]
        assert s.match_prefix(ks) == 2
        out = np.zeros((6, BB), np.uint8)
        with pytest.raises(BlockNotFound) as info:
            s.get(ks, out)
        assert info.value.keys == (ks[2],)
        s.check(repair=True)  # never raises on damaged data
        assert _readable(s, ks[3:]) == [True] * 3
        more = keys(10, 12)
        assert s.put(more, payloads(more, BB)) == [True, True]
    with TieredStore(BB, host_capacity=0, disk_path=tmp_path, disk_capacity=64 * BB) as s:
        assert s.contains(ks[2:3]) == [False]
        assert _readable(s, ks[:2] + ks[3:] + more) == [True] * 7


def test_a_damaged_leaf_page_is_a_miss_and_check_repair_does_not_raise(tmp_path: Path) -> None:
    ks = keys(0, 6)
    data_file = _damaged_store(tmp_path, ks)
    page_at, _ = _node(data_file, ks[0], big=True)
    _patch(data_file, page_at + 10, struct.pack("<H", 0))  # the blocks leaf: no page type
    with TieredStore(BB, host_capacity=4 * BB, disk_path=tmp_path, disk_capacity=64 * BB) as s:
        assert _readable(s, ks[:2]) == [False, False]
        assert s.contains(ks[:2]) == [False, False]
        with pytest.raises(BlockNotFound):
            RemoteAccess(s).pin_resident(ks[2:3])
        assert s.contains(ks[2:3]) == [False]
        report = s.check(repair=True)
        assert sorted(report.corrupt) == sorted(ks[3:])
        assert not report.ok
        assert s.contains(ks) == [False] * 6
        assert s.match_prefix(ks) == 0


def test_a_damaged_page_in_lmdb_index_of_checksums_is_store_corrupt(tmp_path: Path) -> None:
    ks = keys(0, 6)
    data_file = _damaged_store(tmp_path, ks)
    page_at, _ = _node(data_file, ks[0], big=False)
    _patch(data_file, page_at + 10, struct.pack("<H", 0))
    with pytest.raises(StoreCorrupt, match="delete"):
        TieredStore(BB, host_capacity=0, disk_path=tmp_path, disk_capacity=64 * BB)


# -- D: close() keeps what memory held ------------------------------------------------------


def test_close_spills_memory_blocks_to_disk(tmp_path: Path) -> None:
    ks = keys(0, 12)
    with TieredStore(BB, host_capacity=4 * BB, disk_path=tmp_path, disk_capacity=64 * BB) as s:
        s.put(ks, payloads(ks, BB))  # the first four stay only in host memory
    with TieredStore(BB, host_capacity=4 * BB, disk_path=tmp_path, disk_capacity=64 * BB) as s:
        assert s.match_prefix(ks) == 12
        out = np.zeros((12, BB), np.uint8)
        s.get(ks, out)
        np.testing.assert_array_equal(out, payloads(ks, BB))


def test_close_spills_the_newest_into_free_disk_room_only(tmp_path: Path) -> None:
    ks = keys(0, 12)
    with TieredStore(BB, host_capacity=6 * BB, disk_path=tmp_path, disk_capacity=8 * BB) as s:
        s.put(ks[:6], payloads(ks[:6], BB))
        s.put(ks[6:], payloads(ks[6:], BB))  # 0-5 demoted to disk, 6-11 in host
        assert {k for k in ks if k in s.tiers[1]} == set(ks[:6])
    with TieredStore(BB, host_capacity=0, disk_path=tmp_path, disk_capacity=8 * BB) as s:
        # The disk kept what it held; the two free places took the newest host blocks,
        # in their order of use (the newest is evicted last).
        assert _readable(s, ks) == [True] * 6 + [False] * 4 + [True] * 2
        assert list(s.tiers[0].policy.candidates())[-2:] == ks[10:]
