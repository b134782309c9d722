"""``--disk-capacity`` bounds what a real ``kvbridge serve`` puts on disk, whatever clients do
with namespace names: one block in each of many namespaces, a namespace filled many times
over, a restart on the same directory. Disk use is counted as the file system does (the
blocks allocated to every file under the disk path)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from helpers import keys, payloads
from serve import ServeProcess

from kvbridge.store import StoreClient, StoreFull, TieredStore

CAPACITY = 64 << 20
NAMESPACES = 4
BB = 64 << 10


def _used(root: Path) -> int:
    """Bytes the file system allocated to everything under ``root``."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            total += os.stat(os.path.join(folder, name)).st_blocks * 512
    return total


def _server(disk: Path) -> ServeProcess:
    return ServeProcess(
        *("--disk-path", str(disk), "--disk-capacity", str(CAPACITY)),
        *("--max-namespaces", str(NAMESPACES), "--host-capacity", str(16 << 20)),
        *("--handoff-ttl", "0"),
    )


@pytest.mark.slow
def test_one_block_in_each_of_many_namespaces_stays_within_the_capacity(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    server = _server(disk)
    try:
        for n in range(3 * NAMESPACES):
            with StoreClient(server.address, block_bytes=BB, namespace=f"tenant-{n}") as client:
                client.put(keys(n, n + 1), payloads(keys(n, n + 1), BB))
            assert _used(disk) <= CAPACITY
        dirs = [p for p in disk.iterdir() if p.is_dir()]
        assert len(dirs) <= NAMESPACES
        last = 3 * NAMESPACES - 1  # the most recent namespace kept its directory
        with StoreClient(server.address, block_bytes=BB, namespace=f"tenant-{last}") as client:
            out = np.zeros((1, BB), np.uint8)
            client.get(keys(last, last + 1), out)
            assert (out == payloads(keys(last, last + 1), BB)).all()
        with StoreClient(server.address, block_bytes=BB, namespace="tenant-0") as client:
            assert client.match_prefix(keys(0, 1)) == 0  # its directory made way: a miss
    finally:
        server.stop()
    assert _used(disk) <= CAPACITY


@pytest.mark.slow
def test_a_namespace_filled_many_times_over_stays_within_its_share(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    server = _server(disk)
    try:
        with StoreClient(server.address, block_bytes=BB, namespace="big") as client:
            share = CAPACITY // NAMESPACES
            step = client.request_keys
            for start in range(0, 3 * share // BB, step):
                ks = keys(start, start + step)
                client.put(ks, payloads(ks, BB))
                assert _used(disk) <= share
            held = client.stats().tiers[-1].blocks
            assert 0 < held < share // BB  # LMDB's pages and records take their part
            newest = keys(start, start + step)
            out = np.zeros((step, BB), np.uint8)
            client.get(newest, out)
            assert (out == payloads(newest, BB)).all()
    finally:
        server.stop()
    restarted = _server(disk)  # the same directory again: still within the bound
    try:
        with StoreClient(restarted.address, block_bytes=BB, namespace="big") as client:
            assert client.match_prefix(newest) == step
    finally:
        restarted.stop()
    assert _used(disk) <= CAPACITY // NAMESPACES


@pytest.mark.slow
def test_directories_of_an_earlier_run_count_against_the_capacity(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    server = _server(disk)
    try:
        for n in range(NAMESPACES):
            with StoreClient(server.address, block_bytes=BB, namespace=f"old-{n}") as client:
                client.put(keys(n, n + 1), payloads(keys(n, n + 1), BB))
    finally:
        server.stop()
    server = _server(disk)
    try:
        for n in range(NAMESPACES):
            with StoreClient(server.address, block_bytes=BB, namespace=f"new-{n}") as client:
                client.put(keys(n, n + 1), payloads(keys(n, n + 1), BB))
            assert len([p for p in disk.iterdir() if p.is_dir()]) <= NAMESPACES
    finally:
        server.stop()
    assert _used(disk) <= CAPACITY


def test_a_local_store_bounded_by_files_keeps_its_files_within_the_capacity(
    tmp_path: Path,
) -> None:
    capacity = 8 << 20
    with TieredStore(
        BB, host_capacity=0, disk_path=tmp_path, disk_capacity=capacity, disk_bound="files"
    ) as store:
        for start in range(0, 4 * capacity // BB, 16):
            ks = keys(start, start + 16)
            store.put(ks, payloads(ks, BB))
            assert _used(tmp_path) <= capacity
    with pytest.raises(ValueError, match="hold no"):
        TieredStore(
            BB, host_capacity=0, disk_path=tmp_path / "tiny", disk_capacity=BB, disk_bound="files"
        )


def test_a_share_too_small_for_a_block_is_refused_at_open(tmp_path: Path) -> None:
    server = ServeProcess(
        *("--disk-path", str(tmp_path / "disk"), "--disk-capacity", str(8 << 20)),
        *("--max-namespaces", "4", "--host-capacity", str(64 << 20)),
    )
    try:
        with pytest.raises(StoreFull, match="hold no"):
            StoreClient(server.address, block_bytes=4 << 20, namespace="huge-blocks")
    finally:
        server.stop()


@pytest.mark.slow
def test_a_restart_with_a_smaller_capacity_prunes_the_disk_at_start(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    server = _server(disk)  # 4 namespaces of 16 MiB
    try:
        for n in range(NAMESPACES):
            with StoreClient(server.address, block_bytes=BB, namespace=f"n{n}") as client:
                ks = keys(100 * n, 100 * n + 96)
                for start in range(0, len(ks), client.request_keys):
                    chunk = ks[start : start + client.request_keys]
                    client.put(chunk, payloads(chunk, BB))
    finally:
        server.stop()
    assert _used(disk) > 8 << 20
    smaller = ServeProcess(
        *("--disk-path", str(disk), "--disk-capacity", str(8 << 20)),
        *("--max-namespaces", "1", "--host-capacity", str(4 << 20)),
    )
    try:
        assert _used(disk) <= 8 << 20  # before any client came
        with StoreClient(smaller.address, block_bytes=BB, namespace="n0") as client:
            client.put(keys(0, 1), payloads(keys(0, 1), BB))
        assert _used(disk) <= 8 << 20
    finally:
        smaller.stop()
