"""The cache server's namespace table: opening by name, handles, and reclaiming idle ones.

The table has a lock of its own, for its short steps: finding, admitting and reclaiming a
namespace, and making a session one of a namespace's openers. It never waits for a
namespace's lock (a reclaim takes one only if it is free at once). No frame of a namespace
takes it, a request only for a :meth:`NamespaceTable.snapshot` (a lease bound's refusal
sweeps the other namespaces first: ``CacheServer._sweep_others``), and an open makes a new
namespace's store, and a reclaim closes an old one, outside it (``open``). See
``_namespaces`` for what a namespace is and who may use its handle.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..._bounded_log import BoundedLog
from ...transfer import Caller, TransferEngine
from .._errors import StoreFull
from .._lineage import lineage_bytes
from .._wire import BadRequest, NotPermitted, TooManyRequests, UnknownNamespace
from ..local._slots import SlotTier
from ..local._store import TieredStore
from ..local.disk._tier import DiskTier, blocks_within
from ._config import MIN_BLOCK_BYTES, ServerConfig
from ._disk_dirs import FILES_BESIDE_DATA, NamespaceDirs
from ._lease_counts import LeaseCounts
from ._namespaces import Namespace
from ._tenants import Tenant

MAX_NAMESPACE_BYTES = 256
MAX_BLOCK_BYTES = 1 << 30
MAX_NAMESPACES_PER_SESSION = 8
"""Namespaces one session may have open at once (one client squatting every namespace)."""

_log = logging.getLogger("kvbridge.server")


class NamespaceTable:
    """The namespaces a server serves, by handle and by name."""

    def __init__(
        self,
        config: ServerConfig,
        engine: TransferEngine,
        counts: LeaseCounts,
        clock: Callable[[], float],
    ) -> None:
        self._config = config
        self._clock = clock
        self._engine = engine
        self._counts = counts
        self._by_handle: dict[int, Namespace] = {}
        self._by_name: dict[bytes, int] = {}
        self._handles = itertools.count(1)
        self._lock = threading.Lock()
        """The table's: held for its short steps only (never while a store opens or
        closes, never by a namespace's request or frame)."""
        self._opening = threading.Lock()
        """Held by an open that creates a namespace while it reclaims an idle one and makes
        the new store (never the table's lock then): creations one at a time, and an open
        of the same name after."""
        self._events = BoundedLog(_log)  # a client may open and close as fast as it likes
        self._dirs = (
            None
            if config.disk_path is None
            else NamespaceDirs(
                config.disk_path,
                config.max_namespaces,
                config.disk_capacity // config.max_namespaces,
                self._events,
            )
        )

    def snapshot(self) -> list[Namespace]:
        with self._lock:
            return list(self._by_handle.values())

    def get(self, caller: Caller, handle: int) -> Namespace:
        """The namespace ``handle`` names, if ``caller``'s session has it open (a request
        checks that again under the namespace's lock: ``check_opener``)."""
        ns = self._by_handle.get(handle)
        if ns is None or caller.session not in ns.openers:
            raise UnknownNamespace(f"no namespace {handle} open in this session: open it first")
        ns.last_used = time.monotonic()
        return ns

    def check_opener(self, caller: Caller, ns: Namespace) -> None:
        """That ``caller``'s session still has ``ns`` open (under the namespace's lock: a
        namespace reclaimed since :meth:`get` found it has no openers left)."""
        if caller.session not in ns.openers:
            raise UnknownNamespace(f"no namespace {ns.handle} open in this session: open it first")

    def open(
        self,
        caller: Caller,
        name: bytes,
        block_bytes: int,
        tenant: Tenant,
        alive: Callable[[], bool],
        *,
        block_tokens: int = 0,
    ) -> Namespace:
        """Open (or create) the namespace ``name`` for ``caller``'s session, of ``tenant``;
        every check comes before anything changes (a refused open reclaims nothing).
        The table's lock is held for each short step only: a new namespace's store (its
        host memory prefaulted, its LMDB opened: up to seconds with large shares) is made,
        and a reclaimed one closed, outside it. Opens that create run one at a time
        (``_opening``); an open of a namespace being created waits for it there.
        ``alive()`` says whether the caller's session is still open (checked under the
        table's lock as it is made an opener: a session that ends after that finds it
        among the openers and is cleaned up there).

        A namespace belongs to the tenant that created it. A tenant holds at most its
        ``max_namespaces`` (open or idle, in memory and on disk): a new one takes the place
        of its own least recently used idle one, never another tenant's, unless the
        tenants' quotas add up to more than the server serves (the operator's choice). A
        read-only tenant creates nothing: it opens namespaces that are in memory.

        ``block_tokens`` (its creator's): the tokens of each block's lineage the namespace
        keeps (``_lineage``), their memory taken from its host share. An open that states
        others is served all the same (its answer says the namespace's: the client then
        sends no lineage), so that no opener is refused for what another chose first."""
        _check_geometry(name, block_bytes)
        with self._lock:
            ns = self._opened(caller, name, block_bytes, tenant, alive, block_tokens=block_tokens)
        if ns is not None:
            return ns
        with self._opening:
            with self._lock:
                ns = self._opened(
                    caller, name, block_bytes, tenant, alive, block_tokens=block_tokens
                )
                if ns is not None:  # made by the open this one waited for
                    return ns
                reclaimed = self._make_room(block_bytes, tenant)
            if reclaimed is not None:
                self._retire(reclaimed)  # its store closes: no lock held
            with self._lock:
                settings = self._settings(name, block_bytes, tenant, block_tokens)
            store = TieredStore(block_bytes, **settings)  # no lock held: the slow part
            try:
                with self._lock:
                    return self._admit(
                        caller, name, store, tenant, alive, block_tokens=block_tokens
                    )
            except BaseException:
                store.close()
                raise

    def close(self) -> None:
        for ns in self.snapshot():
            if ns.region is not None:
                self._engine.unregister(ns.region)
            ns.close()

    def _opened(
        self,
        caller: Caller,
        name: bytes,
        block_bytes: int,
        tenant: Tenant,
        alive: Callable[[], bool],
        *,
        block_tokens: int,
    ) -> Namespace | None:
        """The namespace ``name`` opened for ``caller`` if it exists; ``None`` if it is to
        be created (each refusal first). Under the table's lock."""
        if not alive():
            raise BadRequest(f"session {caller.session} has ended")
        handle = self._by_name.get(name)
        ns = self._by_handle[handle] if handle is not None else None
        if ns is not None and ns.store.block_bytes != block_bytes:
            raise BadRequest(
                f"namespace {ns.label} has {ns.store.block_bytes}-byte blocks, not {block_bytes}"
            )
        if ns is None or caller.session not in ns.openers:
            mine = sum(caller.session in n.openers for n in self._by_handle.values())
            if mine >= MAX_NAMESPACES_PER_SESSION:
                raise TooManyRequests(f"a session opens at most {MAX_NAMESPACES_PER_SESSION}")
        if ns is None:
            if tenant.read_only:
                raise NotPermitted(
                    f"tenant {tenant.label} is read-only: it opens namespaces in memory only"
                )
            return None
        # One dict store, without the namespace's lock (a busy namespace must not hold the
        # table's lock): the session's end comes after this (the table's lock, alive()).
        ns.openers[caller.session] = caller.principal
        return ns

    def _settings(
        self, name: bytes, block_bytes: int, tenant: Tenant, block_tokens: int
    ) -> dict[str, Any]:
        """The settings of a new namespace's store, its disk directory made room for.
        Under the table's lock, after :meth:`_make_room`. The lineage it may keep (one per
        block it can hold, in memory or on disk) comes out of its host share."""
        cfg = self._config
        share = cfg.host_capacity // cfg.max_namespaces
        disk = _data_share(cfg) if self._dirs is not None else 0
        return {
            "host_capacity": _memory_beside_lineage(share, disk, block_bytes, block_tokens),
            "namespace": name,
            "pin_ttl": cfg.lease_ttl,
            "policy": cfg.policy,
            "prefault": True,
            "clock": self._clock,
            **self._disk_settings(name, block_bytes, tenant),
        }

    def _admit(
        self,
        caller: Caller,
        name: bytes,
        store: TieredStore,
        tenant: Tenant,
        alive: Callable[[], bool],
        *,
        block_tokens: int,
    ) -> Namespace:
        """A store made for ``name`` served as a namespace, ``caller`` its first opener.
        Under the table's lock."""
        if not alive():
            raise BadRequest(f"session {caller.session} has ended")
        handle = next(self._handles)
        ns = Namespace(
            handle,
            name,
            store,
            self._counts,
            owner=tenant.name,
            block_tokens=block_tokens,
            write_only_alarm=self._config.write_only_alarm,
        )
        top = store.tiers[0]
        assert isinstance(top, SlotTier)
        memory = top.memory.array  # type: ignore[attr-defined]
        ns.region = self._engine.register(memory, access="rw", guard=ns.guard)
        ns.openers[caller.session] = caller.principal  # nobody else sees it yet
        self._by_handle[ns.handle] = ns
        self._by_name[name] = ns.handle
        self._events.refused(
            "opened", logging.INFO, "namespace %s opened (handle %d)", ns.label, ns.handle
        )
        return ns

    def _quota(self, tenant: Tenant) -> int:
        return tenant.max_namespaces or self._config.max_namespaces

    def _make_room(self, block_bytes: int, tenant: Tenant) -> Namespace | None:
        """Room for one more namespace of ``tenant`` (its shares checked first, before
        anything is reclaimed): at its quota, its own least recently used idle namespace
        goes; with the server full (quotas that add up to more than it serves), anyone's.
        The one that goes is returned, out of the table, for :meth:`_retire`.
        :class:`TooManyRequests` or :class:`StoreFull` if none can. Under the table's lock."""
        self._check_shares(block_bytes)
        served = self._config.max_namespaces
        quota = self._quota(tenant)
        owned = [n for n in self._by_handle.values() if n.owner == tenant.name]
        if len(owned) >= quota:  # at its quota: only its own may make way
            reclaimed = self._reclaim(owned)
            if reclaimed is not None:
                return reclaimed
            if quota < served:
                raise TooManyRequests(
                    f"tenant {tenant.label} holds {len(owned)} namespaces, all in use "
                    f"(at most {quota}): close a client of one first"
                )
        elif len(self._by_handle) < served:
            return None
        else:
            reclaimed = self._reclaim(list(self._by_handle.values()))
            if reclaimed is not None:
                return reclaimed
        raise StoreFull(f"the server serves at most {served} namespaces, all in use")

    def _check_shares(self, block_bytes: int) -> None:
        cfg = self._config
        host_share = cfg.host_capacity // cfg.max_namespaces
        if host_share < block_bytes:
            raise StoreFull(f"a namespace's {host_share} bytes of host memory hold no block")
        disk_share = _data_share(cfg)
        if cfg.disk_path is not None and not blocks_within(disk_share, block_bytes):
            raise StoreFull(
                f"a namespace's {disk_share} bytes of disk hold no {block_bytes}-byte block "
                "beside LMDB's records"
            )

    def _disk_settings(self, name: bytes, block_bytes: int, tenant: Tenant) -> dict[str, Any]:
        """The disk tier of a new namespace, its directory made room for (``_disk_dirs``)."""
        cfg = self._config
        if self._dirs is None:
            return {}
        path = self._dirs.path_for(name, block_bytes)
        live = {_disk_path(ns) for ns in self._by_handle.values()}
        self._dirs.make_room(path, live, tenant.name, self._quota(tenant))
        return {
            "disk_path": path,
            "disk_capacity": _data_share(cfg),
            "disk_bound": "files",  # the share bounds the files, LMDB's records included
            "write_through": True,
        }

    def _reclaim(self, among: list[Namespace]) -> Namespace | None:
        """The least recently used namespace of ``among`` that no live session has open
        and that holds no lease, unregistered and out of the table (no request or frame
        reaches it any more: it has no openers, and only this lock makes one); ``None`` if
        there is none. Under the table's lock."""
        for ns in sorted(among, key=lambda n: n.last_used):
            if ns.openers or not ns.lock.acquire(blocking=False):
                continue  # in use, or busy: never wait for it under the table's lock
            try:
                ns.leases.sweep()
                if not ns.idle or ns.region is None:
                    continue
                try:
                    self._engine.unregister(ns.region)  # refused while a transfer uses it
                except Exception:
                    continue
            finally:
                ns.lock.release()
            del self._by_handle[ns.handle]
            del self._by_name[ns.name]
            return ns
        return None

    def _retire(self, ns: Namespace) -> None:
        """A reclaimed namespace's store closes (its memory unmapped, its disk synced and
        kept for the next open), with no lock held: nothing reaches it any more."""
        ns.close()
        if self._dirs is not None:
            self._dirs.used(_disk_path(ns))  # kept, the most recently used
        self._events.refused(
            "reclaimed", logging.INFO, "namespace %s reclaimed (handle %d)", ns.label, ns.handle
        )


def _check_geometry(name: bytes, block_bytes: int) -> None:
    if len(name) > MAX_NAMESPACE_BYTES:
        raise BadRequest(f"a namespace is at most {MAX_NAMESPACE_BYTES} bytes")
    if not MIN_BLOCK_BYTES <= block_bytes <= MAX_BLOCK_BYTES:
        raise BadRequest(
            f"block_bytes must be {MIN_BLOCK_BYTES}..{MAX_BLOCK_BYTES}, got {block_bytes}"
        )


def _disk_path(ns: Namespace) -> Path:
    """The directory of a namespace's disk tier (a server with a disk gives every one)."""
    disk = ns.store.tiers[-1]
    assert isinstance(disk, DiskTier)
    return Path(disk.path)


def _memory_beside_lineage(share: int, disk: int, block_bytes: int, block_tokens: int) -> int:
    """Bytes of blocks a host share of ``share`` holds beside the lineage of every block the
    namespace may hold: its memory's, or its disk's where that holds more (write-through:
    the disk has every block). :class:`StoreFull` where not one block fits."""
    each = lineage_bytes(block_tokens)
    memory = share // (block_bytes + each)
    on_disk = disk // block_bytes
    if on_disk > memory:
        memory = max(0, share - on_disk * each) // block_bytes
    if memory < 1:
        raise StoreFull(
            f"a namespace's {share} bytes of host memory hold no block beside the token ids "
            f"of its blocks ({each} bytes each, {max(memory, on_disk)} blocks)"
        )
    return memory * block_bytes


def _data_share(cfg: ServerConfig) -> int:
    """Bytes of a namespace's disk share for LMDB's data file (the rest is its other files)."""
    return max(0, cfg.disk_capacity // cfg.max_namespaces - FILES_BESIDE_DATA)
