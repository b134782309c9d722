"""The disk tier: persistence, checksums, check(), incompatible reopen, fork."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import keys, payload, payloads

from kvbridge.store import BlockNotFound, IncompatibleStore, TieredStore

BB = 4096


def _disk_store(path: Path, **kwargs: object) -> TieredStore:
    options: dict[str, object] = {"host_capacity": 0, "disk_path": path, "disk_capacity": 64 * BB}
    options.update(kwargs)
    return TieredStore(BB, **options)  # type: ignore[arg-type]


def test_blocks_persist_across_reopen(tmp_path: Path) -> None:
    ks = keys(0, 10)
    with _disk_store(tmp_path, namespace=b"m") as s:
        s.put(ks, payloads(ks, BB))
    with _disk_store(tmp_path, namespace=b"m") as s:
        assert s.match_prefix(ks) == 10
        out = np.zeros((10, BB), np.uint8)
        s.get(ks, out)
        np.testing.assert_array_equal(out, payloads(ks, BB))
        assert s.check().ok


def test_eviction_order_survives_reopen(tmp_path: Path) -> None:
    ks = keys(0, 4)
    with _disk_store(tmp_path, disk_capacity=4 * BB, policy="fifo") as s:
        for k in ks:
            s.put([k], payloads([k], BB))
    with _disk_store(tmp_path, disk_capacity=4 * BB, policy="fifo") as s:
        assert list(s.tiers[0].policy.candidates()) == ks
        new = keys(4, 5)
        s.put(new, payloads(new, BB))
        assert s.contains(ks + new) == [False, True, True, True, True]


def test_reopen_with_smaller_capacity_keeps_the_newest(tmp_path: Path) -> None:
    ks = keys(0, 6)
    with _disk_store(tmp_path) as s:
        for k in ks:
            s.put([k], payloads([k], BB))
    with _disk_store(tmp_path, disk_capacity=2 * BB) as s:
        assert s.contains(ks) == [False] * 4 + [True] * 2


def test_reopen_with_other_block_size_or_namespace_is_refused(tmp_path: Path) -> None:
    with _disk_store(tmp_path, namespace=b"llama") as s:
        s.put(keys(0, 1), payloads(keys(0, 1), BB))
    with pytest.raises(IncompatibleStore, match="namespace"):
        _disk_store(tmp_path, namespace=b"mistral")
    with pytest.raises(IncompatibleStore, match="block_bytes"):
        TieredStore(
            2 * BB, host_capacity=0, disk_path=tmp_path, disk_capacity=8 * BB, namespace=b"llama"
        )
    with _disk_store(tmp_path, namespace=b"llama") as s:  # still intact
        assert s.contains(keys(0, 1)) == [True]


def _corrupt_payload(path: Path, block: np.ndarray) -> None:
    """Flip bytes of a stored payload in LMDB's data file, as a torn write or bit rot would."""
    data_file = path / "data.mdb"
    raw = bytearray(data_file.read_bytes())
    at = raw.find(block.tobytes())
    assert at >= 0
    raw[at + 100 : at + 104] = b"\xde\xad\xbe\xef"
    data_file.write_bytes(bytes(raw))


def test_corrupted_block_is_a_miss_never_wrong_bytes(tmp_path: Path) -> None:
    ks = keys(0, 3)
    with _disk_store(tmp_path) as s:
        s.put(ks, payloads(ks, BB))
    _corrupt_payload(tmp_path, payload(ks[1], BB))
    with _disk_store(tmp_path) as s:
        report = s.check()
        assert not report.ok
        assert report.corrupt == [ks[1]]
        out = np.full((3, BB), 9, np.uint8)
        with pytest.raises(BlockNotFound) as info:
            s.get(ks, out)
        assert info.value.keys == (ks[1],)
        assert (out == 9).all()  # nothing was written to out
        assert s.contains(ks) == [True, False, True]  # the bad block was dropped
        assert s.stats().corrupt == 1
        assert s.check().ok
        s.get([ks[0], ks[2]], out[:2])
        np.testing.assert_array_equal(out[:2], payloads([ks[0], ks[2]], BB))


def test_check_repair_drops_bad_blocks(tmp_path: Path) -> None:
    ks = keys(0, 3)
    with _disk_store(tmp_path) as s:
        s.put(ks, payloads(ks, BB))
    _corrupt_payload(tmp_path, payload(ks[2], BB))
    with _disk_store(tmp_path) as s:
        report = s.check(repair=True)
        assert report.repaired and report.corrupt == [ks[2]]
        assert s.contains(ks) == [True, True, False]
        assert s.check().ok


@pytest.mark.slow
def test_large_batches_commit_in_pieces(tmp_path: Path) -> None:
    big = 1 << 20
    ks = keys(0, 80)  # 80 MiB: more than one 64 MiB commit
    data = np.random.default_rng(0).integers(0, 256, (80, big), dtype=np.uint8)
    with TieredStore(big, host_capacity=0, disk_path=tmp_path, disk_capacity=100 * big) as s:
        assert all(s.put(ks, data))
        out = np.zeros_like(data)
        s.get(ks, out)
        np.testing.assert_array_equal(out, data)


def test_forked_child_reopens_the_environment(tmp_path: Path) -> None:
    ks = keys(0, 2)
    with _disk_store(tmp_path) as s:
        s.put(ks, payloads(ks, BB))
        ctx = multiprocessing.get_context("fork")
        parent_end, child_end = ctx.Pipe()

        def child() -> None:
            try:
                out = np.zeros((2, BB), np.uint8)
                s.get(ks, out)  # the inherited store reopens LMDB in this process
                more = keys(2, 3)
                s.put(more, payloads(more, BB))
                child_end.send(bool((out == payloads(ks, BB)).all()))
            except BaseException as exc:
                child_end.send(repr(exc))
            os._exit(0)

        proc = ctx.Process(target=child)
        proc.start()
        assert parent_end.poll(30)
        assert parent_end.recv() is True
        proc.join(30)
        assert proc.exitcode == 0
        # The parent's handle still works, and sees the child's commit on disk.
        out = np.zeros((2, BB), np.uint8)
        s.get(ks, out)
        np.testing.assert_array_equal(out, payloads(ks, BB))
    with _disk_store(tmp_path) as s:
        assert s.contains(keys(0, 3)) == [True, True, True]
