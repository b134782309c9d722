"""The cache server's namespace table: opening by name, handles, and reclaiming idle ones.

Only the control thread changes the table (under the server's state lock, and its own lock
for readers on other threads: metrics, stats). See ``_namespaces`` for what a namespace is
and who may use its handle.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..transfer import Caller, TransferEngine
from ._disk import DiskTier, blocks_within
from ._disk_dirs import NamespaceDirs
from ._errors import StoreFull
from ._namespaces import Namespace
from ._server_config import MIN_BLOCK_BYTES, ServerConfig
from ._slots import SlotTier
from ._store import TieredStore
from ._wire import BadRequest, TooManyRequests, UnknownNamespace

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
        state: threading.Lock,
        clock: Callable[[], float],
    ) -> None:
        self._config = config
        self._clock = clock
        self._engine = engine
        self._state = state
        self._by_handle: dict[int, Namespace] = {}
        self._by_name: dict[bytes, int] = {}
        self._handles = itertools.count(1)
        self._lock = threading.Lock()
        self._dirs = (
            None
            if config.disk_path is None
            else NamespaceDirs(config.disk_path, config.max_namespaces)
        )

    def snapshot(self) -> list[Namespace]:
        with self._lock:
            return list(self._by_handle.values())

    def get(self, caller: Caller, handle: int) -> Namespace:
        """The namespace ``handle`` names, if ``caller``'s session has it open."""
        ns = self._by_handle.get(handle)
        if ns is None or caller.session not in ns.openers:
            raise UnknownNamespace(f"no namespace {handle} open in this session: open it first")
        ns.last_used = time.monotonic()
        return ns

    def open(
        self, caller: Caller, name: bytes, block_bytes: int, max_open: int | None = None
    ) -> Namespace:
        """Open (or create) the namespace ``name`` for ``caller``'s session, whose principal
        (tenant) may have at most ``max_open`` namespaces open at once; every check comes
        before anything changes (a refused open reclaims nothing)."""
        if len(name) > MAX_NAMESPACE_BYTES:
            raise BadRequest(f"a namespace is at most {MAX_NAMESPACE_BYTES} bytes")
        if not MIN_BLOCK_BYTES <= block_bytes <= MAX_BLOCK_BYTES:
            raise BadRequest(
                f"block_bytes must be {MIN_BLOCK_BYTES}..{MAX_BLOCK_BYTES}, got {block_bytes}"
            )
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
        if max_open is not None and (ns is None or not ns.open_for(caller.principal)):
            theirs = sum(n.open_for(caller.principal) for n in self._by_handle.values())
            if theirs >= max_open:
                raise TooManyRequests(
                    f"tenant {caller.principal or 'default'} has {theirs} namespaces open "
                    f"(at most {max_open}): close a client of one first"
                )
        if ns is None:
            ns = self._create(name, block_bytes)
        ns.openers[caller.session] = caller.principal
        return ns

    def close(self) -> None:
        for ns in self.snapshot():
            if ns.region is not None:
                self._engine.unregister(ns.region)
            ns.store.close()

    def _create(self, name: bytes, block_bytes: int) -> Namespace:
        cfg = self._config
        host_share = cfg.host_capacity // cfg.max_namespaces
        if host_share < block_bytes:  # checked before anything is reclaimed for it
            raise StoreFull(f"a namespace's {host_share} bytes of host memory hold no block")
        disk_share = cfg.disk_capacity // cfg.max_namespaces
        if cfg.disk_path is not None and not blocks_within(disk_share, block_bytes):
            raise StoreFull(
                f"a namespace's {disk_share} bytes of disk hold no {block_bytes}-byte block "
                "beside LMDB's records"
            )
        if len(self._by_handle) >= cfg.max_namespaces:
            self._reclaim()
        disk = self._disk_settings(name, block_bytes)
        store = TieredStore(
            block_bytes,
            host_capacity=host_share,
            namespace=name,
            pin_ttl=cfg.lease_ttl,
            policy=cfg.policy,
            prefault=True,
            clock=self._clock,
            **disk,
        )
        ns = Namespace(next(self._handles), name, store, self._state)
        top = store.tiers[0]
        assert isinstance(top, SlotTier)
        try:
            memory = top.memory.array  # type: ignore[attr-defined]
            ns.region = self._engine.register(memory, access="rw", guard=ns.guard)
        except BaseException:
            store.close()
            raise
        with self._lock:
            self._by_handle[ns.handle] = ns
            self._by_name[name] = ns.handle
        _log.info("namespace %s opened (handle %d)", ns.label, ns.handle)
        return ns

    def _disk_settings(self, name: bytes, block_bytes: int) -> dict[str, Any]:
        """The disk tier of a new namespace, its directory made room for (``_disk_dirs``)."""
        cfg = self._config
        if self._dirs is None:
            return {}
        path = self._dirs.path_for(name, block_bytes)
        self._dirs.make_room(path, {_disk_path(ns) for ns in self._by_handle.values()})
        return {
            "disk_path": path,
            "disk_capacity": cfg.disk_capacity // cfg.max_namespaces,
            "disk_bound": "files",  # the share bounds the files, LMDB's records included
            "write_through": True,
        }

    def _reclaim(self) -> None:
        """Close the least recently used namespace that no live session has open and that
        holds no lease, to make room for a new one; :class:`StoreFull` if there is none."""
        for ns in sorted(self._by_handle.values(), key=lambda n: n.last_used):
            ns.sweep()
            if not ns.idle or ns.region is None:
                continue
            try:
                self._engine.unregister(ns.region)  # refused while a transfer still uses it
            except Exception:
                continue
            with self._lock:
                del self._by_handle[ns.handle]
                del self._by_name[ns.name]
            ns.store.close()
            if self._dirs is not None:
                self._dirs.used(_disk_path(ns))  # kept, the most recently used
            _log.info("namespace %s reclaimed (handle %d)", ns.label, ns.handle)
            return
        raise StoreFull(
            f"the server serves at most {self._config.max_namespaces} namespaces, all in use"
        )


def _disk_path(ns: Namespace) -> Path:
    """The directory of a namespace's disk tier (a server with a disk gives every one)."""
    disk = ns.store.tiers[-1]
    assert isinstance(disk, DiskTier)
    return Path(disk.path)
