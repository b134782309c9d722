"""kvbridge as an SGLang HiCache backend, against sglang 0.5.23's real ``HiCacheStorage``,
loaded the way SGLang loads it (``StorageBackendFactory``, backend ``dynamic``), over host
pools that carry SGLang's own page code (``host_pools.py``) and a real cache server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from host_pools import MHAPool, MLAPool
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from kvbridge.bindings import LayoutError
from kvbridge.bindings.sglang import KVBridgeHiCache
from kvbridge.store import CacheServer, ConfigError, ServerConfig

LOAD = {
    "backend_name": "kvbridge",
    "module_path": "kvbridge.bindings.sglang",
    "class_name": "KVBridgeHiCache",
}


@pytest.fixture
def server() -> Iterator[CacheServer]:
    with CacheServer(ServerConfig(port=0, host_capacity=64 << 20)) as srv:
        yield srv


def storage(extra: dict[str, Any], **change: Any) -> HiCacheStorageConfig:
    fields: dict[str, Any] = {
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": False,
        "enable_storage_metrics": False,
        "is_page_first_layout": True,
        "model_name": "org/model",
        "extra_config": {**LOAD, **extra},
    }
    fields.update(change)
    return HiCacheStorageConfig(**fields)


def backend(pool: Any, extra: dict[str, Any], **change: Any) -> KVBridgeHiCache:
    """Made by SGLang's own factory, then given its host pool as the controller does."""
    made = StorageBackendFactory.create_backend("dynamic", storage(extra, **change), pool)
    made.register_mem_pool_host(pool)
    assert isinstance(made, KVBridgeHiCache)
    return made


def names(count: int, tag: str = "p") -> list[str]:
    """Page keys as SGLang makes them: 64 hex digits (a SHA-256 chain)."""
    return [f"{tag}{i:063x}"[-64:] for i in range(count)]


def namespace_stats(server: CacheServer) -> dict[str, int]:
    """Summed counters of every namespace on the server."""
    names = ("puts", "duplicates", "bytes_in", "hits")
    total = dict.fromkeys(names, 0)  # no namespace yet (the backend dials in the background)
    for entry in server.stats()["namespaces"]:
        for name in names:
            total[name] += int(entry[name])
    return total


# -- loading and settings -----------------------------------------------------------------


def test_sglang_loads_it_as_a_hicache_storage(server: CacheServer) -> None:
    made = backend(MHAPool(), {"server": server.address, "interface_v1": 1})
    assert isinstance(made, HiCacheStorage)
    assert made.zero_copy
    assert made.batch_exists(names(3)) == 0
    made.close()


@pytest.mark.parametrize(
    ("extra", "change", "match"),
    [
        ({"serverr": "x:1"}, {}, "unknown kvbridge connector setting.*serverr"),
        ({"timeout": "5"}, {}, "timeout must be a number"),
        ({"async_load": True}, {}, "vLLM settings"),
        ({"timeout": 1e10}, {}, "timeout must be a positive number of seconds up to"),
        ({"server": "not-an-address"}, {}, "server: .*no port"),
        ({"server": "127.0.0.1:99999"}, {}, "server: .*port"),
        ({}, {"is_mla_model": True, "tp_size": 2, "tp_rank": 1}, "set server"),
        ({}, {"tp_lcm_size": 4, "should_split_heads": True}, "tp_lcm_size"),
    ],
)
def test_bad_settings_are_config_errors(
    extra: dict[str, Any], change: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        KVBridgeHiCache(storage(extra, **change))


def test_a_backend_without_its_host_pool_answers_misses() -> None:
    made = KVBridgeHiCache(storage({"interface_v1": 1}))
    assert made.batch_exists(names(2)) == 0
    assert not made.exists(names(1)[0])
    assert made.batch_get_v1(names(2), torch.arange(8)) == [False, False]
    assert made.batch_set_v1(names(2), torch.arange(8)) == [False, False]


# -- round trips, byte for byte -----------------------------------------------------------

POOLS = [
    pytest.param(lambda: MHAPool("page_first"), id="mha-page_first"),
    pytest.param(lambda: MHAPool("layer_first"), id="mha-layer_first"),
    pytest.param(lambda: MHAPool("page_first_direct"), id="mha-page_first_direct"),
    pytest.param(lambda: MHAPool("page_head"), id="mha-page_head"),
    pytest.param(lambda: MHAPool("page_first", dtype=torch.float32), id="mha-float32"),
    pytest.param(lambda: MLAPool("page_first"), id="mla-page_first"),
    pytest.param(lambda: MLAPool("layer_first"), id="mla-layer_first"),
    pytest.param(lambda: MLAPool("page_first_direct"), id="mla-page_first_direct"),
]


@pytest.mark.parametrize("make", POOLS)
def test_zero_copy_set_then_get_byte_for_byte(server: CacheServer, make: Any) -> None:
    """Pages written from one pool's slots land in another pool's other slots unchanged."""
    source, target = make(), make()
    source.fill(seed=1)
    extra = {"server": server.address, "interface_v1": 1}
    writer, reader = backend(source, extra), backend(target, extra)
    keys = names(5)
    assert writer.batch_set_v1(keys, source.slots(3, 0, 7, 12, 5)) == [True] * 5
    assert reader.batch_exists(keys) == 5
    assert reader.batch_get_v1(keys, target.slots(1, 2, 9, 15, 4)) == [True] * 5
    for src, dst in zip((3, 0, 7, 12, 5), (1, 2, 9, 15, 4), strict=True):
        ps = source.page_size
        assert target.page_bytes(dst * ps) == source.page_bytes(src * ps)
    untouched = [p for p in range(target.page_num) if p not in (1, 2, 9, 15, 4)]
    assert all(not any(target.page_bytes(p * target.page_size)) for p in untouched)
    writer.close()
    reader.close()


@pytest.mark.parametrize("make", POOLS)
def test_copying_set_then_get_byte_for_byte(server: CacheServer, make: Any) -> None:
    """SGLang's copying interface: flat pages from ``get_data_page`` in, dummy pages filled
    and written back with ``set_from_flat_data_page`` (as its controller does)."""
    source, target = make(), make()
    source.fill(seed=2)
    extra = {"server": server.address}
    writer, reader = backend(source, extra), backend(target, extra)
    keys, ps = names(4), source.page_size
    assert writer.batch_set(keys, [source.get_data_page(p * ps) for p in (2, 8, 1, 6)])
    pages = reader.batch_get(keys, [target.get_dummy_flat_data_page() for _ in keys])
    assert all(page is not None for page in pages)
    for page, dst in zip(pages, (0, 3, 4, 11), strict=True):
        target.set_from_flat_data_page(dst * ps, page)
    for src, dst in zip((2, 8, 1, 6), (0, 3, 4, 11), strict=True):
        assert target.page_bytes(dst * ps) == source.page_bytes(src * ps)
    single = reader.get(keys[0])
    assert single is not None
    assert bytes(single.view(torch.uint8).numpy()) == source.page_bytes(2 * ps)
    writer.close()
    reader.close()


def test_the_two_interfaces_keep_apart(server: CacheServer) -> None:
    """For ``layer_first`` the zero-copy segments and SGLang's flat page order bytes
    differently: a page stored through one interface is not found through the other."""
    pool = MHAPool("layer_first")
    pool.fill(seed=3)
    zero = backend(pool, {"server": server.address, "interface_v1": 1})
    flat = backend(MHAPool("layer_first"), {"server": server.address})
    keys = names(2)
    assert zero.batch_set_v1(keys, pool.slots(0, 1)) == [True, True]
    assert flat.batch_exists(keys) == 0
    with pytest.raises(ConfigError, match="interface_v1"):
        flat.batch_get_v1(keys, pool.slots(0, 1))
    zero.close()
    flat.close()


# -- prefixes, dedup, partial hits --------------------------------------------------------


def test_batch_exists_counts_leading_hits(server: CacheServer) -> None:
    pool = MHAPool()
    pool.fill(seed=4)
    made = backend(pool, {"server": server.address, "interface_v1": 1})
    keys = names(6)
    assert made.batch_set_v1(keys[:2] + keys[3:5], pool.slots(0, 1, 3, 4)) == [True] * 4
    assert made.batch_exists(keys) == 2  # the third page is missing
    assert made.batch_exists(keys[:2]) == 2
    assert made.batch_exists(keys[3:]) == 2
    assert made.batch_exists(keys[2:]) == 0
    assert made.exists(keys[4]) and not made.exists(keys[5])
    made.close()


def test_a_second_set_of_the_same_pages_moves_no_bytes(server: CacheServer) -> None:
    pool = MHAPool()
    pool.fill(seed=5)
    made = backend(pool, {"server": server.address, "interface_v1": 1})
    keys = names(8)
    assert made.batch_set_v1(keys, pool.slots(*range(8))) == [True] * 8
    first = namespace_stats(server)
    assert made.batch_set_v1(keys, pool.slots(*range(8))) == [True] * 8
    second = namespace_stats(server)
    assert second["bytes_in"] == first["bytes_in"] > 0
    assert second["puts"] == first["puts"] == 8
    assert second["duplicates"] - first["duplicates"] == 8
    # half new, half old: only the new half moves
    more = keys[4:] + names(4, tag="q")
    assert made.batch_set_v1(more, pool.slots(*range(8, 16))) == [True] * 8
    assert namespace_stats(server)["puts"] == 12
    made.close()


def test_a_missing_page_ends_a_get_and_nothing_after_it_is_written(server: CacheServer) -> None:
    source, target = MHAPool(), MHAPool()
    source.fill(seed=6)
    extra = {"server": server.address, "interface_v1": 1}
    writer, reader = backend(source, extra), backend(target, extra)
    keys = names(4)
    assert writer.batch_set_v1([keys[0], keys[1], keys[3]], source.slots(0, 1, 3)) == [True] * 3
    assert reader.batch_get_v1(keys, target.slots(4, 5, 6, 7)) == [True, True, False, False]
    ps = target.page_size
    assert target.page_bytes(4 * ps) == source.page_bytes(0)
    assert not any(target.page_bytes(7 * ps))  # a page after the gap stays as it was
    flat_w = backend(source, {"server": server.address})
    flat_r = backend(MHAPool(), {"server": server.address})
    assert flat_w.batch_set([keys[0], keys[2]], [source.get_data_page(0), source.get_data_page(ps)])
    got = flat_r.batch_get(keys[:3])
    assert got[0] is not None and got[1] is None and got[2] is None
    for made in (writer, reader, flat_w, flat_r):
        made.close()


def test_clear_empties_this_namespace_only(server: CacheServer) -> None:
    pool = MHAPool()
    pool.fill(seed=13)
    mine = backend(pool, {"server": server.address, "interface_v1": 1})
    other = backend(pool, {"server": server.address, "interface_v1": 1, "namespace": "b"})
    keys = names(4)
    assert mine.batch_set_v1(keys, pool.slots(0, 1, 2, 3)) == [True] * 4
    assert other.batch_set_v1(keys, pool.slots(0, 1, 2, 3)) == [True] * 4
    assert mine.clear()
    assert mine.batch_exists(keys) == 0
    assert other.batch_exists(keys) == 4
    assert mine.batch_set_v1(keys, pool.slots(0, 1, 2, 3)) == [True] * 4  # usable after it
    assert mine.batch_exists(keys) == 4
    mine.close()
    other.close()


# -- namespaces -----------------------------------------------------------------------------

APART = [
    pytest.param(lambda: MHAPool(dtype=torch.float16), {}, id="dtype"),
    pytest.param(lambda: MHAPool(page_size=8, pages=8), {}, id="page size"),
    pytest.param(lambda: MHAPool("page_first_direct"), {}, id="layout"),
    pytest.param(lambda: MHAPool(heads=4, head_dim=32), {}, id="heads"),
    pytest.param(MHAPool, {"tp_rank": 1, "tp_size": 2}, id="tp rank"),
    pytest.param(MHAPool, {"pp_rank": 1, "pp_size": 2}, id="pp rank"),
]


@pytest.mark.parametrize(("make", "change"), APART)
def test_another_engine_or_layout_never_reads_these_pages(
    server: CacheServer, make: Any, change: dict[str, Any]
) -> None:
    pool = MHAPool()
    pool.fill(seed=7)
    mine = backend(pool, {"server": server.address, "interface_v1": 1})
    keys = names(3)
    assert mine.batch_set_v1(keys, pool.slots(0, 1, 2)) == [True] * 3
    other_pool = make()
    other = backend(other_pool, {"server": server.address, "interface_v1": 1}, **change)
    assert other.batch_exists(keys) == 0
    assert other.batch_get_v1(keys, other_pool.slots(0, 1, 2)) == [False] * 3
    assert not any(other_pool.page_bytes(0))
    same = backend(MHAPool(), {"server": server.address, "interface_v1": 1})
    assert same.batch_exists(keys) == 3
    for made in (mine, other, same):
        made.close()


def test_the_namespace_setting_and_mla_ranks(server: CacheServer) -> None:
    """The user's namespace keeps deployments apart; MLA pages are the same on every TP
    rank, so rank 1 reads what rank 0 wrote."""
    pool = MLAPool()
    pool.fill(seed=8)
    extra = {"server": server.address, "interface_v1": 1}
    rank0 = backend(pool, extra, is_mla_model=True, tp_size=2)
    keys = names(2)
    assert rank0.batch_set_v1(keys, pool.slots(0, 1)) == [True, True]
    rank1 = backend(MLAPool(), extra, is_mla_model=True, tp_size=2, tp_rank=1)
    assert rank1.batch_exists(keys) == 2
    tenant = backend(MLAPool(), {**extra, "namespace": "b"}, is_mla_model=True, tp_size=2)
    assert tenant.batch_exists(keys) == 0
    for made in (rank0, rank1, tenant):
        made.close()


# -- bad arguments --------------------------------------------------------------------------

BAD_SLOTS = [
    pytest.param(lambda p: torch.arange(6), id="not whole pages"),
    pytest.param(lambda p: torch.arange(2, 10), id="not on a page"),
    pytest.param(lambda p: torch.tensor([0, 1, 3, 2, 4, 5, 6, 7]), id="not one run"),
    pytest.param(lambda p: torch.arange(p.size - 4, p.size + 4), id="past the pool"),
    pytest.param(lambda p: torch.arange(-4, 4), id="negative"),
    pytest.param(lambda p: torch.arange(8, dtype=torch.float32), id="floats"),
    pytest.param(lambda p: torch.arange(4), id="fewer pages than keys"),
    pytest.param(lambda p: torch.cat([torch.arange(4), torch.arange(4)]), id="a page twice"),
    pytest.param(lambda p: torch.arange(8).reshape(2, 4), id="two rows"),
    pytest.param(lambda p: [0.5] * 8, id="a list of floats"),
]


@pytest.mark.parametrize("slots", BAD_SLOTS)
def test_bad_host_indices_are_layout_errors_and_move_nothing(
    server: CacheServer, slots: Any
) -> None:
    pool = MHAPool()
    pool.fill(seed=9)
    made = backend(pool, {"server": server.address, "interface_v1": 1})
    keys = names(2)
    before = bytes(pool.kv_buffer.view(torch.uint8).reshape(-1).numpy())
    with pytest.raises(LayoutError):
        made.batch_set_v1(keys, slots(pool))
    assert namespace_stats(server)["bytes_in"] == 0
    assert made.batch_set_v1(keys, pool.slots(0, 1)) == [True, True]
    with pytest.raises(LayoutError):
        made.batch_get_v1(keys, slots(pool))
    assert bytes(pool.kv_buffer.view(torch.uint8).reshape(-1).numpy()) == before
    made.close()


def test_bad_page_tensors_are_layout_errors(server: CacheServer) -> None:
    pool = MHAPool()
    made = backend(pool, {"server": server.address})
    page = pool.get_dummy_flat_data_page()
    with pytest.raises(LayoutError, match="bytes"):
        made.batch_set(names(1), [page[:-1]])
    with pytest.raises(LayoutError, match="tensor"):
        made.set(names(1)[0], None)
    with pytest.raises(LayoutError, match="2 key"):
        made.batch_get(names(2), [page])
    with pytest.raises(TypeError, match="strings"):
        made.batch_exists([b"bytes-key"])  # type: ignore[list-item]
    assert namespace_stats(server)["bytes_in"] == 0
    made.close()
