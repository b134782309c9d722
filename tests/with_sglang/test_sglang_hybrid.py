"""kvbridge under SGLang 0.5.23's ``HybridCacheController``, the controller of every model
there: a plain model's pool group (its KV pool alone) and hybrid models' (a Mamba state
pool, an SWA side pool) registered as SGLang registers them, backed up, looked up and
prefetched by SGLang's own hit query, prefetch and backup code (``controller.Hybrid``),
over SGLang's own ``MambaPoolHost`` (``host_pools.mamba_pool``) and a real cache server.

A node's side pages are written as SGLang's radix cache asks for them at backup
(``unified_cache/components/mamba.py`` and ``swa.py``, ``build_hicache_transfers``,
``BACKUP_STORAGE``: Mamba, the state after the node's last page under that page's key;
SWA, the node's last pages, up to the window), and asked for as at prefetch (``PREFETCH``:
placeholder keys, one for Mamba, one per window page for SWA, that SGLang's
``_sync_trailing_keys`` replaces with the hit's last pages)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from controller import HostGroup, Hybrid
from host_pools import MHAPool, MLAPool, fill_mamba, mamba_pool, state_bytes
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str
from test_sglang_backend import storage

from kvbridge.bindings import LayoutError
from kvbridge.bindings.sglang import KVBridgeHiCache
from kvbridge.bindings.sglang._hybrid import MAX_STOP_POINTS, last_stop
from kvbridge.store import CacheServer, ConfigError, ServerConfig

PAGE = 4
"""Tokens per page (``--page-size``) of every pool here."""

TOKENS = list(range(1000, 1000 + 8 * PAGE))
"""A prompt of 8 pages: two radix-tree nodes of 4 pages each."""

KEYS: list[str] = get_storage_hash_str(TOKENS, None, page_size=PAGE)
"""SGLang's page keys of ``TOKENS`` (its SHA-256 chain)."""

TRAILING = PoolHitPolicy.TRAILING_PAGES


@pytest.fixture
def server() -> Iterator[CacheServer]:
    with CacheServer(ServerConfig(port=0, host_capacity=64 << 20)) as srv:
        yield srv


def hybrid(pools: dict[str, Any], extra: dict[str, Any], **change: Any) -> Hybrid:
    """A backend made by SGLang's factory, under SGLang's hybrid controller, with the
    group's pools registered as SGLang 0.5.23 registers them."""
    anchor = next(iter(pools.values()))
    made = StorageBackendFactory.create_backend("dynamic", storage(extra, **change), anchor)
    assert isinstance(made, KVBridgeHiCache)
    controller = Hybrid(made, HostGroup(pools))
    controller.attach()
    return controller


def mamba_state(slot: int, last_page: int) -> PoolTransfer:
    """Backup: the state in host slot ``slot``, after page ``last_page`` (a node's end)."""
    return PoolTransfer(
        name=PoolName.MAMBA,
        host_indices=torch.tensor([slot]),
        keys=[KEYS[last_page]],
        hit_policy=TRAILING,
    )


def swa_pages(pool: Any, slots: list[int], pages: list[int]) -> PoolTransfer:
    """Backup: a node's last SWA pages ``pages``, from the pool's page slots ``slots``."""
    return PoolTransfer(
        name=PoolName.SWA,
        host_indices=pool.slots(*slots),
        keys=[KEYS[p] for p in pages],
        hit_policy=TRAILING,
    )


def wanted(name: PoolName, pages: int = 1) -> PoolTransfer:
    """Prefetch: a side pool's ask before the hit is known (placeholder keys)."""
    return PoolTransfer(name=name, keys=["__placeholder__"] * pages, hit_policy=TRAILING)


# -- every model registers through v2 in 0.5.23 ---------------------------------------------


@pytest.mark.parametrize("zero_copy", [1, 0], ids=["zero-copy", "copying"])
def test_a_plain_model_starts_and_round_trips_under_the_hybrid_controller(
    server: CacheServer, zero_copy: int
) -> None:
    """SGLang 0.5.23 registers a plain model's KV pool twice (anchor, then ``kv``): the
    backend takes it, and pages go out and back through SGLang's own paths."""
    extra = {"server": server.address, "interface_v1": zero_copy}
    source, target = MHAPool(), MHAPool()
    source.fill(seed=1)
    writer = hybrid({"kv": source}, extra)
    assert writer.backup(KEYS, source.slots(*range(8))) == 8 * PAGE
    reader = hybrid({"kv": target}, extra)
    operation = reader.query(TOKENS)
    assert operation.storage_hit_count == 8 * PAGE
    assert reader.fetch(operation, target.slots(*range(8, 16)), {}).tokens == 8 * PAGE
    assert target.page_bytes(8 * PAGE) == source.page_bytes(0)
    assert target.page_bytes(15 * PAGE) == source.page_bytes(7 * PAGE)
    for controller in (writer, reader):
        controller.storage_backend.close()


# -- Mamba state ------------------------------------------------------------------------------


@pytest.mark.parametrize("zero_copy", [1, 0], ids=["zero-copy", "copying"])
def test_a_mamba_hybrid_gets_the_state_at_the_end_of_its_hit(
    server: CacheServer, zero_copy: int
) -> None:
    """Two nodes backed up with their end states; another engine hits all 8 pages and
    gets the KV pages and the second node's state, byte for byte."""
    extra = {"server": server.address, "interface_v1": zero_copy}
    kv, states = MHAPool(), mamba_pool()
    kv.fill(seed=2)
    fill_mamba(states, seed=3)
    writer = hybrid({"kv": kv, "mamba": states}, extra)
    assert writer.backup(KEYS[:4], kv.slots(0, 1, 2, 3), [mamba_state(1, 3)]) == 4 * PAGE
    assert writer.backup(KEYS[4:], kv.slots(4, 5, 6, 7), [mamba_state(2, 7)]) == 4 * PAGE

    kv2, states2 = MHAPool(), mamba_pool()
    reader = hybrid({"kv": kv2, "mamba": states2}, extra)
    operation = reader.query(TOKENS, [wanted(PoolName.MAMBA)])
    assert operation.storage_hit_count == 8 * PAGE
    fetched = reader.fetch(operation, kv2.slots(*range(8, 16)), {"mamba": torch.tensor([6])})
    assert fetched.tokens == 8 * PAGE
    assert fetched.pool_hits["mamba"] == 1
    assert state_bytes(states2, 6) == state_bytes(states, 2)
    assert kv2.page_bytes(15 * PAGE) == kv.page_bytes(7 * PAGE)
    stats = reader.storage_backend.stats()
    assert stats["pools"]["mamba"]["bytes_loaded"] == states.get_dummy_flat_data_page().nbytes
    for controller in (writer, reader):
        controller.storage_backend.close()


def test_without_a_state_at_the_kv_hit_the_hit_ends_at_the_last_state(
    server: CacheServer,
) -> None:
    """The second node's KV is stored but not its state: the hit is the first node (4
    pages), whose state loads; a prompt ending mid-node finds the same boundary."""
    extra = {"server": server.address, "interface_v1": 1}
    kv, states = MHAPool(), mamba_pool()
    kv.fill(seed=4)
    fill_mamba(states, seed=5)
    writer = hybrid({"kv": kv, "mamba": states}, extra)
    writer.backup(KEYS[:4], kv.slots(0, 1, 2, 3), [mamba_state(1, 3)])
    writer.backup(KEYS[4:], kv.slots(4, 5, 6, 7))

    kv2, states2 = MHAPool(), mamba_pool()
    reader = hybrid({"kv": kv2, "mamba": states2}, extra)
    assert reader.storage_backend.batch_exists(KEYS) == 8  # the KV pages alone
    for prompt in (TOKENS, TOKENS[: 6 * PAGE]):
        operation = reader.query(prompt, [wanted(PoolName.MAMBA)])
        assert operation.storage_hit_count == 4 * PAGE
    fetched = reader.fetch(operation, kv2.slots(8, 9, 10, 11), {"mamba": torch.tensor([3])})
    assert fetched == type(fetched)(4 * PAGE, {"mamba": 1})
    assert state_bytes(states2, 3) == state_bytes(states, 1)
    for controller in (writer, reader):
        controller.storage_backend.close()


def test_no_state_anywhere_is_a_miss(server: CacheServer) -> None:
    extra = {"server": server.address, "interface_v1": 1}
    kv = MHAPool()
    writer = hybrid({"kv": kv, "mamba": mamba_pool()}, extra)
    writer.backup(KEYS, kv.slots(*range(8)))
    reader = hybrid({"kv": MHAPool(), "mamba": mamba_pool()}, extra)
    assert reader.query(TOKENS, [wanted(PoolName.MAMBA)]).storage_hit_count == 0
    for controller in (writer, reader):
        controller.storage_backend.close()


def test_the_in_process_store_refuses_side_pools_saying_to_set_a_server() -> None:
    """The in-process store serves one namespace (``bindings/core/_embedded.py``); a side
    pool needs another. A plain model's registration still works there."""
    plain = hybrid({"kv": MHAPool()}, {"interface_v1": 1})
    plain.storage_backend.close()
    with pytest.raises(ConfigError, match=r"mamba pool needs a namespace of its own.*set server"):
        hybrid({"kv": MHAPool(), "mamba": mamba_pool()}, {"interface_v1": 1})


# -- SWA side pool ----------------------------------------------------------------------------


@pytest.mark.parametrize("zero_copy", [1, 0], ids=["zero-copy", "copying"])
def test_an_swa_hybrid_gets_the_window_before_its_hit(server: CacheServer, zero_copy: int) -> None:
    """Each node keeps its last 2 SWA pages (the window); another engine hits all 8 KV
    pages and gets the SWA pages 6 and 7, byte for byte."""
    extra = {"server": server.address, "interface_v1": zero_copy}
    kv, swa = MHAPool(layers=2), MHAPool(layers=1, heads=4)
    kv.fill(seed=8)
    swa.fill(seed=9)
    writer = hybrid({"kv": kv, "swa": swa}, extra)
    writer.backup(KEYS[:4], kv.slots(0, 1, 2, 3), [swa_pages(swa, [2, 3], [2, 3])])
    writer.backup(KEYS[4:], kv.slots(4, 5, 6, 7), [swa_pages(swa, [6, 7], [6, 7])])

    kv2, swa2 = MHAPool(layers=2), MHAPool(layers=1, heads=4)
    reader = hybrid({"kv": kv2, "swa": swa2}, extra)
    operation = reader.query(TOKENS, [wanted(PoolName.SWA, pages=2)])
    assert operation.storage_hit_count == 8 * PAGE
    fetched = reader.fetch(operation, kv2.slots(*range(8, 16)), {"swa": swa2.slots(10, 11)})
    assert fetched.pool_hits["swa"] == 2
    assert swa2.page_bytes(10 * PAGE) == swa.page_bytes(6 * PAGE)
    assert swa2.page_bytes(11 * PAGE) == swa.page_bytes(7 * PAGE)
    for controller in (writer, reader):
        controller.storage_backend.close()


def test_an_swa_window_with_a_page_missing_moves_the_hit_down(server: CacheServer) -> None:
    """The second node kept only its last SWA page: the window before page 8 (6, 7) is
    not whole, nor any up to page 6; the first node's (2, 3) is: a hit of 4 pages."""
    extra = {"server": server.address, "interface_v1": 1}
    kv, swa = MHAPool(), MHAPool()
    swa.fill(seed=10)
    writer = hybrid({"kv": kv, "swa": swa}, extra)
    writer.backup(KEYS[:4], kv.slots(0, 1, 2, 3), [swa_pages(swa, [2, 3], [2, 3])])
    writer.backup(KEYS[4:], kv.slots(4, 5, 6, 7), [swa_pages(swa, [7], [7])])
    reader = hybrid({"kv": MHAPool(), "swa": MHAPool()}, extra)
    assert reader.query(TOKENS, [wanted(PoolName.SWA, pages=2)]).storage_hit_count == 4 * PAGE
    for controller in (writer, reader):
        controller.storage_backend.close()


def test_an_swa_pool_like_the_kv_pool_keeps_its_own_pages(server: CacheServer) -> None:
    """The SWA pool has the KV pool's class and geometry: its pages are still another
    namespace's, so KV pages alone give no SWA hit."""
    extra = {"server": server.address, "interface_v1": 1}
    kv = MHAPool()
    writer = hybrid({"kv": kv, "swa": MHAPool()}, extra)
    writer.backup(KEYS, kv.slots(*range(8)))
    backend = writer.storage_backend
    result = backend.batch_exists_v2(KEYS, [wanted(PoolName.SWA, pages=2)])
    assert (result.kv_hit_pages, result.extra_pool_hit_pages) == (0, {PoolName.KV: 8})
    assert backend._pools["swa"].core.namespace != backend._pools["kv"].core.namespace
    backend.close()


# -- Mamba and SWA together -------------------------------------------------------------------


def test_mamba_and_swa_together_hit_where_both_can(server: CacheServer) -> None:
    """Mamba's state is at the end of pages 4 and 8, the SWA window whole before 4 only:
    the hit is 4 pages."""
    extra = {"server": server.address, "interface_v1": 1}
    kv, swa, states = MHAPool(), MHAPool(layers=2), mamba_pool()
    writer = hybrid({"kv": kv, "swa": swa, "mamba": states}, extra)
    writer.backup(KEYS[:4], kv.slots(0, 1, 2, 3), [swa_pages(swa, [3], [3]), mamba_state(1, 3)])
    writer.backup(KEYS[4:], kv.slots(4, 5, 6, 7), [mamba_state(2, 7)])
    reader = hybrid({"kv": MHAPool(), "swa": MHAPool(layers=2), "mamba": mamba_pool()}, extra)
    operation = reader.query(TOKENS, [wanted(PoolName.SWA), wanted(PoolName.MAMBA)])
    assert operation.storage_hit_count == 4 * PAGE
    for controller in (writer, reader):
        controller.storage_backend.close()


# -- the search for a stop point, alone --------------------------------------------------------


def test_the_stop_point_search() -> None:
    present = {1, 2, 5, 6, 9}

    def held(first: int, last: int) -> int:
        count = 0
        for page in range(first, last):
            if page not in present:
                break
            count += 1
        return count

    assert last_stop(10, [(1, held)]) == 10  # page 9 is there
    assert last_stop(9, [(1, held)]) == 7  # page 6
    assert last_stop(9, [(2, held)]) == 7  # pages 5, 6
    assert last_stop(9, [(3, held)]) == 0  # no three in a row
    assert last_stop(9, [(1, held), (2, held)]) == 7
    assert last_stop(4, [(2, held)]) == 3  # pages 1, 2
    assert last_stop(5, []) == 5
    far = MAX_STOP_POINTS + 10  # only page 0 holds a state: too far down to look
    assert last_stop(far, [(1, lambda first, last: int(first == 0))]) == 0


# -- what is refused, and faults ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name", [PoolName.INDEXER, PoolName.DEEPSEEK_V4_C4, PoolName.DRAFT, PoolName.AUXILIARY_SWA]
)
def test_side_pools_it_does_not_take_are_refused_saying_what_to_do(
    server: CacheServer, name: PoolName
) -> None:
    kv = MHAPool()
    made = StorageBackendFactory.create_backend(
        "dynamic", storage({"server": server.address, "interface_v1": 1}), kv
    )
    made.register_mem_pool_host(kv)
    made.register_mem_host_pool_v2(kv, PoolName.KV)
    with pytest.raises(ConfigError, match=rf"host pool '{name.value}' \(MHAPool\).*mamba.*swa"):
        made.register_mem_host_pool_v2(MHAPool(), name)
    with pytest.raises(ConfigError, match="without --hicache-storage-backend"):
        made.register_mem_host_pool_v2(MHAPool(), name)
    assert made.batch_exists(KEYS) == 0  # closed by the refusal: misses from here on
    made.close()


@pytest.mark.parametrize(
    "pools",
    [{"kv": MHAPool(layers=1)}, {"kv": MHAPool(), "swa": MHAPool(layers=1)}],
    ids=["kv", "swa"],
)
def test_pages_under_the_server_s_smallest_block_are_refused_at_start(
    server: CacheServer, pools: dict[str, Any]
) -> None:
    name = list(pools)[-1]
    with pytest.raises(ConfigError, match=f"the {name} host pool's pages are 2048 bytes"):
        hybrid(pools, {"server": server.address, "interface_v1": 1})


def test_a_kv_pool_other_than_the_anchor_is_refused(server: CacheServer) -> None:
    made = StorageBackendFactory.create_backend(
        "dynamic", storage({"server": server.address}), MHAPool()
    )
    made.register_mem_pool_host(MHAPool())
    with pytest.raises(ConfigError, match="not the anchor pool"):
        made.register_mem_host_pool_v2(MHAPool(), PoolName.KV)
    made.close()


def test_an_anchor_that_keeps_no_pages_is_refused(server: CacheServer) -> None:
    """SGLang's allocator-only pools (an MLA host pool in dummy mode) have no kv_buffer."""
    anchor = MLAPool()
    anchor.kv_buffer = None
    made = KVBridgeHiCache(storage({"server": server.address}))
    with pytest.raises(LayoutError, match="keeps no pages of its own"):
        made.register_mem_pool_host(anchor)


def test_a_transfer_for_a_pool_never_registered_or_of_bad_slots_moves_nothing(
    server: CacheServer,
) -> None:
    extra = {"server": server.address, "interface_v1": 1}
    kv, states = MHAPool(), mamba_pool()
    backend = hybrid({"kv": kv, "mamba": states}, extra).storage_backend
    swa = PoolTransfer(name=PoolName.SWA, host_indices=kv.slots(0), keys=KEYS[:1])
    with pytest.raises(LayoutError, match="no host pool 'swa'"):
        backend.batch_set_v2([mamba_state(1, 3), swa])
    two_keys = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([1]), keys=KEYS[:2])
    with pytest.raises(LayoutError, match="2 key"):
        backend.batch_set_v2([mamba_state(1, 3), two_keys])
    outside = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([99]), keys=KEYS[:1])
    with pytest.raises(LayoutError, match="outside"):
        backend.batch_get_v2([outside])
    result = backend.batch_exists_v2(KEYS, [wanted(PoolName.MAMBA)])
    assert result.kv_hit_pages == 0  # nothing was written by the refused calls
    assert backend.stats()["pools"]["mamba"]["bytes_saved"] == 0
    backend.close()


def test_a_server_gone_is_misses_and_failed_writes_in_the_v2_calls() -> None:
    kv, states = MHAPool(), mamba_pool()
    with CacheServer(ServerConfig(port=0, host_capacity=64 << 20)) as srv:
        extra = {"server": srv.address, "interface_v1": 1, "timeout": 2}
        controller = hybrid({"kv": kv, "mamba": states}, extra)
        controller.backup(KEYS[:4], kv.slots(0, 1, 2, 3), [mamba_state(1, 3)])
    backend = controller.storage_backend
    assert backend.batch_exists_v2(KEYS, [wanted(PoolName.MAMBA)]).kv_hit_pages == 0
    assert backend.batch_get_v2([mamba_state(2, 3)]) == {PoolName.MAMBA: [False]}
    assert backend.batch_set_v2([mamba_state(2, 3)]) == {PoolName.MAMBA: [False]}
    assert controller.query(TOKENS, [wanted(PoolName.MAMBA)]).storage_hit_count == 0
    backend.close()


def test_v2_calls_before_sglang_registers_a_pool_are_misses() -> None:
    made = KVBridgeHiCache(storage({"interface_v1": 1}))
    assert made.batch_exists_v2(KEYS, [wanted(PoolName.MAMBA)]).kv_hit_pages == 0
    assert made.batch_get_v2([mamba_state(1, 3)]) == {PoolName.MAMBA: [False]}
    assert made.batch_set_v2([mamba_state(1, 3)]) == {PoolName.MAMBA: [False]}


# -- identity ---------------------------------------------------------------------------------


def test_mamba_state_is_sharded_by_rank_even_for_an_mla_model(server: CacheServer) -> None:
    """An MLA model's KV (and an SWA side pool's) is the same on every TP rank; Mamba state
    is not: SGLang writes it from every rank."""
    extra = {"server": server.address, "interface_v1": 1}
    mla = {"is_mla_model": True, "tp_size": 2}
    backends = [
        hybrid(
            {"kv": MLAPool(), "mamba": mamba_pool(), "swa": MLAPool(layers=2, kv_cache_dim=256)},
            extra,
            **mla,
            tp_rank=rank,
        ).storage_backend
        for rank in (0, 1)
    ]
    spaces = [{n: p.core.namespace for n, p in b._pools.items()} for b in backends]
    assert spaces[0]["kv"] == spaces[1]["kv"]
    assert spaces[0]["swa"] == spaces[1]["swa"]
    assert spaces[0]["mamba"] != spaces[1]["mamba"]
    assert backends[1]._pools["mamba"].core.identity.shard.startswith("tp1/2,")
    for backend in backends:
        backend.close()
