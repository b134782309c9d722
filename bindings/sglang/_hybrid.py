"""A model's host pools in kvbridge, one namespace each: SGLang 0.5.23's v2 storage calls.

SGLang 0.5.23 builds every model's HiCache as a ``HostPoolGroup`` under a
``HybridCacheController`` (``mem_cache/registry.py`` ``create_unified_radix_cache``, then
``hybrid_cache/hybrid_pool_assembler.py`` ``attach_hybrid_pool_to_unified_cache``). When
it attaches a storage backend it gives the anchor KV pool to ``register_mem_pool_host``,
then every pool of the group, the anchor again included (as ``kv``), to
``register_mem_host_pool_v2(pool, name)``, then calls ``on_host_pools_registered()``
(``hybrid_cache_controller.py`` ``attach_storage_backend``). A plain model's group is its
KV pool alone. A hybrid model's adds side pools, which SGLang moves through the v2 calls
only, each side page named by the hash of the KV page it belongs to:

- ``batch_exists_v2(keys, transfers)``: the KV pages' leading hit and, for each side pool,
  whether it can serve a prefix that long (:func:`hit_query`);
- ``batch_get_v2(transfers)``, ``batch_set_v2(transfers)``: each transfer is one pool's
  ``keys`` and ``host_indices``. A hybrid model's KV pages still move through
  ``batch_get_v1``/``batch_set_v1`` (or the copying calls), as any model's.

Two kinds of side pool are taken (:data:`SIDE_POOLS`), each in a namespace of its own
(:func:`~._config.side_identity`), so that one page hash names another block in each pool:

- ``mamba`` (``MambaPoolHost``): one slot per page (its ``page_size`` is 1): the recurrent
  state after the KV page its key names, written only at the end of a radix-tree node
  (``unified_cache/components/mamba.py``, ``build_hicache_transfers``). It moves as
  SGLang's flat page (``get_data_page``, ``set_from_flat_data_page``): its parts (the
  temporal state, the conv states, any per-slot side state) differ in size, and kvbridge's
  zero-copy path moves a page as parts of one size.
- ``swa`` (a KV host pool of the sliding-window layers): the last pages of each node, up
  to the window (``unified_cache/components/swa.py``). It moves as the anchor does:
  zero-copy with ``interface_v1``, else as flat pages.

Side pools need a cache server (``server``): the in-process store serves one namespace.
Other side pools (DSA and QSA indexers, DeepSeek V4's compressed pools, draft-model pools)
are refused when SGLang registers them, saying so: SGLang then fails at start, as it does
for any backend that cannot take the model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from sglang.srt.mem_cache.hicache_storage import (
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from ...store import ConfigError
from ..core._config import ConnectorConfig
from ..core._core import ConnectorCore
from ..core._identity import Identity
from ..core._pages import LayoutError
from ._config import side_identity
from ._pool import HostPages, check_page_bytes, flat_bytes, whole_pages

KV = PoolName.KV.value
"""SGLang's name for the anchor KV pool."""

SIDE_POOLS = {"mamba": "flat pages", "swa": "as the anchor"}
"""The side pools kvbridge takes, by SGLang's ``PoolName`` value, and how their pages move."""

MAX_STOP_POINTS = 64
"""How many prefix lengths a hit query tries, from the KV hit down, when a side pool must
hold the pages just before the end (Mamba, SWA: one lookup per such pool and try). A
lookup took 0.4 ms on the development machine (loopback, the server in the same process,
two shared cores), so a query that finds nothing stays near 25 ms per such pool. Past it
the hit is 0 pages: a miss, never a hit that a pool cannot serve."""


class StoredPool:
    """One of SGLang's host pools and its pages in the store: ``core`` (its namespace)
    moves them zero-copy through ``pages``, or, where ``pages`` is None, as SGLang's flat
    pages (``get_data_page`` to save, ``set_from_flat_data_page`` after a load). Owns
    ``core``."""

    def __init__(self, name: str, pool: Any, core: ConnectorCore, pages: HostPages | None) -> None:
        self.name = name
        self.pool = pool
        self.core = core
        self._pages = pages
        self._page_tokens = int(pool.page_size)
        self._capacity = int(pool.size)

    @property
    def zero_copy(self) -> bool:
        return self._pages is not None

    def held(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, the store holds for this pool."""
        return self.core.lookup(self.core.named(keys)) if keys else 0

    def check(self, keys: Sequence[str], host_indices: Any) -> np.ndarray:
        """The first slot of each page at ``host_indices``; raises :class:`LayoutError`
        unless they are whole pages of this pool, one per key."""
        slots = whole_pages(
            np.zeros(0, dtype=np.int64) if host_indices is None else host_indices,
            self._page_tokens,
            self._capacity,
        )
        if slots.size != len(keys) * self._page_tokens:
            raise LayoutError(
                f"{len(keys)} key(s) for {slots.size // self._page_tokens} page(s) "
                f"of the {self.name} host pool"
            )
        return slots[:: self._page_tokens]

    def load(self, keys: Sequence[str], host_indices: Any) -> int:
        """Fill the pages at ``host_indices``; how many, from the first, were loaded."""
        starts = self.check(keys, host_indices)
        if not keys:
            return 0
        named = self.core.named(keys)
        if self._pages is not None:
            return self.core.load_leading(named, host_indices)
        block = self.core.identity.block_bytes
        pages = [self.pool.get_dummy_flat_data_page() for _ in keys]
        got = self.core.get(named, [flat_bytes(p, block, writable=True) for p in pages])
        for start, page in zip(starts[:got], pages, strict=False):
            self.pool.set_from_flat_data_page(int(start), page)
        return got

    def save(self, keys: Sequence[str], host_indices: Any) -> bool:
        """Store the pages at ``host_indices`` (those the store holds are not sent);
        False when the store failed."""
        starts = self.check(keys, host_indices)
        if not keys:
            return True
        named = self.core.named(keys)
        if self._pages is not None:
            return self.core.save(named, host_indices)
        block = self.core.identity.block_bytes
        data = [self.pool.get_data_page(int(s), flat=True) for s in starts]
        return self.core.put(named, [flat_bytes(d, block, writable=False) for d in data])

    def close(self) -> None:
        self.core.close()


def open_side_pool(
    name: str,
    pool: Any,
    storage: Any,
    config: ConnectorConfig,
    kv: Identity,
    *,
    zero_copy: bool,
    connections: int,
) -> StoredPool:
    """The side pool ``name`` of a hybrid model, in a namespace of its own derived from
    the KV pool's identity ``kv``, on the configured server. Raises :class:`ConfigError`
    for a pool kvbridge does not take or without a server, and :class:`LayoutError` for
    one whose pages it cannot see."""
    if name not in SIDE_POOLS:
        taken = ", ".join(f"{n} ({how})" for n, how in SIDE_POOLS.items())
        raise ConfigError(
            f"kvbridge: SGLang registered host pool {name!r} ({type(pool).__name__}) of a "
            f"hybrid model, which kvbridge does not store: it takes the KV pool and the side "
            f"pools {taken}. Serve this model without --hicache-storage-backend, or with a "
            "backend that stores this pool"
        )
    if config.server is None:
        raise ConfigError(
            f"kvbridge: this hybrid model's {name} pool needs a namespace of its own, and "
            "the in-process store (no server set) serves one: set server (a kvbridge serve "
            "whose --max-namespaces covers every pool of every rank on it)"
        )
    pages = HostPages(pool) if zero_copy and SIDE_POOLS[name] == "as the anchor" else None
    if pages is None:
        block_bytes, path = int(pool.get_dummy_flat_data_page().nbytes), "flat"
    else:
        block_bytes, path = pages.block_bytes, "segments"
    check_page_bytes(name, block_bytes)
    ident = side_identity(kv, storage, pool, name=name, block_bytes=block_bytes, path=path)
    core = ConnectorCore(config, ident, connections=connections)
    try:
        if pages is not None:
            core.attach(pages)
    except BaseException:
        core.close()
        raise
    return StoredPool(name, pool, core, pages)


def hit_query(
    keys: Sequence[str],
    kv_pages: int,
    transfers: Sequence[PoolTransfer],
    pools: Mapping[str, StoredPool],
) -> PoolTransferResult:
    """``batch_exists_v2``'s answer, given the KV pool's leading hit ``kv_pages``: the
    longest prefix every pool of ``transfers`` can serve, by its hit policy:

    - ``ALL_PAGES``: the pool holds every page of the prefix (its leading hit bounds it);
    - ``TRAILING_PAGES`` (Mamba: the last page; SWA: the last ``len(keys)`` pages): the
      pool holds the pages just before the prefix's end. Such a pool leaves holes (a state
      at the end of 5 pages and of 2, none at 3 or 4), so the search goes down from the
      longest candidate; a window with a page missing rules out every end up to that page,
      the next candidate is the page itself.

    ``restorable_prefix_pages`` holds that one prefix length where a pool has a window
    (SGLang intersects the ranks' lists: a rank reporting only its longest one may make a
    shorter hit that all ranks could serve a miss, never a wrong hit), and every length up
    to it otherwise. ``extra_pool_hit_pages``: the KV pool's leading hit, an ``ALL_PAGES``
    pool's own, and the prefix found for a windowed pool."""
    hits: dict[Any, int] = {}
    if kv_pages:
        hits[PoolName.KV] = kv_pages
    end = kv_pages
    windows: list[tuple[PoolTransfer, int, StoredPool]] = []
    for transfer in transfers:
        pool = registered(pools, transfer.name)
        if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
            held = pool.held(keys[:kv_pages])
            if held:
                hits[transfer.name] = held
            end = min(end, held)
        elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
            windows.append((transfer, max(1, len(transfer.keys or ())), pool))
        else:
            raise LayoutError(f"hit policy {transfer.hit_policy} of pool {transfer.name}")

    def probe(pool: StoredPool) -> Callable[[int, int], int]:
        return lambda first, last: pool.held(keys[first:last])

    end = last_stop(end, [(width, probe(pool)) for _, width, pool in windows])
    if not windows:
        return PoolTransferResult(end, hits, list(range(1, end + 1)))
    for transfer, _, _ in windows:
        if end:
            hits[transfer.name] = end
    return PoolTransferResult(end, hits, [end] if end else [])


def last_stop(end: int, windows: Sequence[tuple[int, Callable[[int, int], int]]]) -> int:
    """The longest prefix, at most ``end`` pages, at which every window is whole: for each
    ``(width, held)``, ``held(first, last)`` counts the leading pages of ``[first, last)``
    its pool holds, and the ``width`` pages before the end must all be there. Tries at
    most :data:`MAX_STOP_POINTS` ends; 0 when none of them is."""
    for _ in range(MAX_STOP_POINTS):
        if end == 0 or not windows:
            return end
        below = end
        for width, held in windows:
            first = max(0, end - width)
            got = held(first, end)
            if got < end - first:  # page first + got is missing: no end up to it works
                below = min(below, first + got)
        if below == end:
            return end
        end = below
    return 0


def registered(pools: Mapping[str, StoredPool], name: Any) -> StoredPool:
    """The pool SGLang calls ``name``; :class:`LayoutError` if it never registered one."""
    pool = pools.get(str(name))
    if pool is None:
        raise LayoutError(f"SGLang registered no host pool {str(name)!r} with this backend")
    return pool


def close_pools(pools: Mapping[str, StoredPool]) -> None:
    """Side pools first: the KV pool's core may run the in-process store they use."""
    for name in sorted(pools, key=lambda n: n == KV):
        pools[name].close()
