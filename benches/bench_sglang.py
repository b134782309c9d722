"""The SGLang HiCache backend against its baselines, in the same run.

- Zero-copy page sets and gets (``batch_set_v1``/``batch_get_v1``: a page is its K and V
  halves, two ops) against ``StoreClient.put_from``/``get_into`` of the same bytes as one
  contiguous block: the cost of SGLang's page layout and the backend's bookkeeping.
- The same against SGLang's own ``HiCacheFile`` backend (its copying interface, files on
  tmpfs): the peer that ships with SGLang.
- ``batch_exists`` while a large ``batch_set_v1`` is in flight on another thread (SGLang's
  prefetch and backup threads), against ``batch_exists`` alone: what the backend's three
  connections buy.

Runs where sglang is installed: ``tests/with_sglang/run`` makes ``.venv-sglang``; then
``.venv-sglang/bin/python -m pytest benches/bench_sglang.py -s``.
"""

from __future__ import annotations

import itertools
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "sglang", reason="sglang is not installed: tests/with_sglang/run makes .venv-sglang"
)

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile

sys.path[:0] = [
    str(Path(__file__).parents[1] / "tests"),
    str(Path(__file__).parents[1] / "tests" / "with_sglang"),
]
from host_pools import MHAPool  # noqa: E402
from serve import ServeProcess  # noqa: E402
from test_sglang_backend import backend, storage  # noqa: E402

import kvbridge.bindings.sglang as sglang_binding  # noqa: E402
from kvbridge.store import StoreClient  # noqa: E402

PAGES = 64
"""Pages per call (SGLang's batches hold up to 128)."""


def _pool() -> MHAPool:
    """``PAGES`` pages of 16 tokens of an 8-layer model with 8 KV heads of 128, bfloat16:
    512 KiB a page (two 256 KiB halves, K and V)."""
    return MHAPool(pages=PAGES, page_size=16, layers=8, heads=8, head_dim=128)


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    proc = ServeProcess("--host-capacity", "1GiB", "--handoff-ttl", "0")
    yield proc
    proc.kill()


def _names(round_: int) -> list[str]:
    return [f"{round_:032x}{i:032x}" for i in range(PAGES)]


def test_sglang_zero_copy_set(compare: Callable[..., Any], server: ServeProcess) -> None:
    pool = _pool()
    pool.fill(seed=1)
    made = backend(pool, {"server": server.address, "interface_v1": 1, "namespace": "set"})
    slots = pool.slots(*range(PAGES))
    block = pool.get_dummy_flat_data_page().nbytes
    flat = torch.zeros(PAGES * block, dtype=torch.uint8).numpy()
    rounds = itertools.count()
    with StoreClient(server.address, block_bytes=block, namespace="plain-set") as plain:
        region = plain.register(flat)
        offsets = [i * block for i in range(PAGES)]
        compare(
            f"sglang batch_set_v1, {PAGES} pages of {block >> 10} KiB",
            lambda: all(made.batch_set_v1(_names(next(rounds)), slots)) or pytest.fail("set"),
            lambda: plain.put_from(made_keys(next(rounds)), region, offsets),
            baseline_name="StoreClient.put_from, same bytes, 1 op per page",
            nbytes=PAGES * block,
            rounds=10,
        )
    made.close()


def made_keys(round_: int) -> list[bytes]:
    return [round_.to_bytes(16, "big") + i.to_bytes(16, "big") for i in range(PAGES)]


def test_sglang_zero_copy_get(compare: Callable[..., Any], server: ServeProcess) -> None:
    source, target = _pool(), _pool()
    source.fill(seed=2)
    extra = {"server": server.address, "interface_v1": 1, "namespace": "get"}
    writer, reader = backend(source, extra), backend(target, extra)
    keys, slots = _names(0), source.slots(*range(PAGES))
    assert all(writer.batch_set_v1(keys, slots))
    block = source.get_dummy_flat_data_page().nbytes
    flat = torch.zeros(PAGES * block, dtype=torch.uint8).numpy()
    with StoreClient(server.address, block_bytes=block, namespace="plain-get") as plain:
        region = plain.register(flat)
        offsets = [i * block for i in range(PAGES)]
        plain.put_from(made_keys(0), region, offsets)
        compare(
            f"sglang batch_get_v1, {PAGES} pages of {block >> 10} KiB",
            lambda: all(reader.batch_get_v1(keys, slots)) or pytest.fail("get"),
            lambda: plain.get_into(made_keys(0), region, offsets),
            baseline_name="StoreClient.get_into, same bytes, 1 op per page",
            nbytes=PAGES * block,
        )
    assert all(target.page_bytes(p * 16) == source.page_bytes(p * 16) for p in range(PAGES))
    writer.close()
    reader.close()


@pytest.fixture
def hicache_file() -> Iterator[HiCacheFile]:
    path = Path("/dev/shm") / f"kvbridge-bench-{time.monotonic_ns()}"
    yield HiCacheFile(storage({}), str(path))
    shutil.rmtree(path, ignore_errors=True)


def test_sglang_set_against_hicache_file(
    compare: Callable[..., Any], server: ServeProcess, hicache_file: HiCacheFile
) -> None:
    """Both through SGLang's interface as its controller drives them: kvbridge zero-copy
    from the host pool; HiCacheFile (copying) from ``get_data_page`` copies."""
    source = _pool()
    source.fill(seed=3)
    writer = backend(source, {"server": server.address, "interface_v1": 1, "namespace": "peer"})
    slots, ps = source.slots(*range(PAGES)), source.page_size
    rounds = itertools.count()

    def file_set() -> None:
        names = _names(next(rounds))
        hicache_file.batch_set(names, [source.get_data_page(p * ps) for p in range(PAGES)])

    compare(
        f"sglang set {PAGES} pages, kvbridge vs HiCacheFile",
        lambda: all(writer.batch_set_v1(_names(next(rounds)), slots)) or pytest.fail("set"),
        file_set,
        baseline_name="HiCacheFile.batch_set on /dev/shm",
        nbytes=PAGES * source.get_dummy_flat_data_page().nbytes,
        rounds=10,
    )
    writer.close()


def test_sglang_get_against_hicache_file(
    compare: Callable[..., Any], server: ServeProcess, hicache_file: HiCacheFile
) -> None:
    """kvbridge zero-copy into the host pool; HiCacheFile into dummy pages that
    ``set_from_flat_data_page`` writes back (SGLang's copying get)."""
    source, target = _pool(), _pool()
    source.fill(seed=4)
    extra = {"server": server.address, "interface_v1": 1, "namespace": "peer-get"}
    writer, reader = backend(source, extra), backend(target, extra)
    slots, ps = source.slots(*range(PAGES)), source.page_size
    keys = _names(10**6)
    assert all(writer.batch_set_v1(keys, slots))
    hicache_file.batch_set(keys, [source.get_data_page(p * ps) for p in range(PAGES)])

    def file_get() -> None:
        pages = hicache_file.batch_get(keys, [target.get_dummy_flat_data_page() for _ in keys])
        for p, page in enumerate(pages):
            target.set_from_flat_data_page(p * ps, page)

    compare(
        f"sglang get {PAGES} pages, kvbridge vs HiCacheFile",
        lambda: all(reader.batch_get_v1(keys, slots)) or pytest.fail("get"),
        file_get,
        baseline_name="HiCacheFile.batch_get on /dev/shm",
        nbytes=PAGES * source.get_dummy_flat_data_page().nbytes,
    )
    writer.close()
    reader.close()


@pytest.mark.parametrize("connections", [3, 1])
def test_sglang_lookup_beside_a_backup(
    server: ServeProcess, connections: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """p50 of ``batch_exists`` (128 keys, 64 held) while another thread runs
    ``batch_set_v1`` of 64 new pages (32 MiB) six times, against the same lookups with
    nothing else running. (Six: more would make the namespace evict the looked-up pages.)
    With the backend's 3 connections, and with 1 (every call behind the one in flight)."""
    monkeypatch.setattr(sglang_binding, "_CONNECTIONS", connections)
    pool = _pool()
    pool.fill(seed=5)
    extra = {"server": server.address, "interface_v1": 1, "namespace": f"busy{connections}"}
    made = backend(pool, extra)
    keys = _names(7) + _names(8)
    assert all(made.batch_set_v1(_names(7), pool.slots(*range(PAGES))))
    alone = [_lookup(made, keys) for _ in range(200)]

    def backup() -> None:
        for round_ in range(100, 106):
            made.batch_set_v1(_names(round_), pool.slots(*range(PAGES)))

    writer = threading.Thread(target=backup)
    writer.start()
    busy = []
    while writer.is_alive():
        busy.append(_lookup(made, keys))
    writer.join()
    p50, p50_alone = statistics.median(busy), statistics.median(alone)
    print(
        f"\nsglang batch_exists p50 beside a backup, {connections} connection(s): "
        f"{p50 * 1e6:.0f} us ({len(busy)} lookups) "
        f"vs {p50_alone * 1e6:.0f} us alone; max {max(busy) * 1e3:.1f} ms vs "
        f"{max(alone) * 1e3:.1f} ms"
    )
    made.close()


def _lookup(made: Any, keys: list[str]) -> float:
    start = time.perf_counter()
    assert made.batch_exists(keys) == PAGES
    return time.perf_counter() - start
