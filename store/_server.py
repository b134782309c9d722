"""CacheServer: tiered stores, one per namespace, behind a transfer engine.

Clients reach the server's engine (``StoreClient`` dials ``host:port``); their control
requests ride the engine's authenticated ``call`` channel and run on its control thread,
one at a time, each a few store operations under the store's lock. Bytes never pass
through the control path: a client writes blocks straight into staged slots of the
namespace's host slab, and reads pinned slots straight out of it, with the engine.

Put: ``stage`` (slots under a lease) -> the client writes -> ``commit`` (only now visible).
The commit normally rides the data stream as the write's notification: the server commits
on the serve thread once the bytes landed, before the client's write completes, so a put
costs one control round trip; refusing it (``LeaseExpired``) fails the client's write.
Get: ``pin`` (blocks lifted into host memory, pinned under a lease) -> the client reads ->
``release``. Leases expire after ``lease_ttl``: a client that dies loses them and their
slots come back; a commit or release after expiry is refused (``LeaseExpired``), so bytes
that may have been overwritten are never trusted. Remote writes are accepted only into
slots of open staged puts (the region's guard), so no client can overwrite a stored block.

With a disk tier every commit is written through to it: a killed server loses no committed
block, and a restart on the same ``disk_path`` serves them again.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
import numpy as np

from ..transfer import NotifyRefused, Region, TransferEngine
from ._errors import LeaseExpired, StoreError, StoreFull
from ._metrics import ServerMetrics
from ._pins import Lease
from ._server_config import ServerConfig
from ._slots import SlotTier
from ._stats import StoreStats
from ._store import TieredStore
from ._wire import (
    BadRequest,
    TooManyRequests,
    UnknownNamespace,
    error_reply,
    keys_field,
)
from ._wire import (
    field as message_field,
)

MAX_NAMESPACE_BYTES = 256
MAX_BLOCK_BYTES = 1 << 30


class _Staged(NamedTuple):
    deadline: float
    keys: list[bytes]
    """The keys that got a slot (what the commit makes visible)."""


@dataclass
class _Namespace:
    handle: int
    name: bytes
    store: TieredStore
    region: Region | None = None
    stagings: dict[int, tuple[str, _Staged]] = field(default_factory=dict)
    pins: dict[int, tuple[str, Lease]] = field(default_factory=dict)
    unread: OrderedDict[bytes, float] = field(default_factory=OrderedDict)
    """Committed blocks still held for their first read: key -> handoff pin deadline."""

    @property
    def label(self) -> str:
        text = self.name.decode("utf-8", "replace")
        return f"{text}/{self.store.block_bytes}"

    def guard(self, access: str, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Remote writes land only in slots that open staged puts own."""
        if access != "w":
            return np.ones(len(offsets), dtype=bool)
        block = np.uint64(self.store.block_bytes)
        first = (offsets // block).astype(np.int64)
        last = ((offsets + lengths - np.uint64(1)) // block).astype(np.int64)
        return self.store.writable_slots(first, last)


class CacheServer:
    """A standalone KV-block cache: ``CacheServer(config)``, then clients connect to
    ``address``; ``close()`` stops it (also a context manager)."""

    def __init__(self, config: ServerConfig | None = None) -> None:
        self.config = config or ServerConfig()
        cfg = self.config
        self.engine = TransferEngine(
            "kvbridge-server",
            host=cfg.host,
            port=cfg.port,
            transports=cfg.transports,
            secret=cfg.secret,
        )
        self._namespaces: dict[int, _Namespace] = {}
        self._by_name: dict[bytes, int] = {}
        self._owned: Counter[str] = Counter()
        self._lock = threading.Lock()  # namespaces: the control thread adds, metrics read
        self._started = time.time()
        self.metrics = ServerMetrics(self._store_stats)
        self.metrics_port: int | None = None
        try:
            if cfg.metrics_port is not None:
                self.metrics_port = self.metrics.serve(cfg.host, cfg.metrics_port)
        except BaseException:
            self.engine.close()
            raise
        self.address = self.engine.address
        self._ops = {
            "open": self._open,
            "contains": self._contains,
            "match": self._match,
            "stage": self._stage,
            "commit": self._commit,
            "abort": self._abort,
            "pin": self._pin,
            "release": self._release,
            "remove": self._remove,
            "stats": self._stats,
        }
        self._closed = False
        self._state = threading.Lock()  # leases and namespaces: control and serve threads
        self.engine.set_request_handler(self._handle)
        self.engine.set_notify_handler(self._on_notify)

    def close(self) -> None:
        """Stop answering, close every stream, then close the stores (disk synced)."""
        if self._closed:
            return
        self._closed = True
        self.engine.close()  # joins the control thread: no request is mid-way after this
        self.metrics.close()
        with self._lock:
            namespaces = list(self._namespaces.values())
        for ns in namespaces:
            if ns.region is not None:
                self.engine.unregister(ns.region)
            ns.store.close()

    def __enter__(self) -> CacheServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        return self._stats("", {})

    # -- dispatch ----------------------------------------------------------------------

    def _handle(self, client: str, body: dict[str, Any]) -> dict[str, Any]:
        op = body.get("op")
        handler = self._ops.get(op) if isinstance(op, str) else None
        label = op if handler is not None else "unknown"
        start = time.perf_counter()
        try:
            if handler is None:
                raise BadRequest(f"unknown op {op!r}; known: {sorted(self._ops)}")
            with self._state:
                return handler(client, body)
        except StoreError as exc:
            self.metrics.errors.labels(label, type(exc).__name__).inc()
            return error_reply(exc)
        except (ValueError, TypeError, KeyError) as exc:
            self.metrics.errors.labels(label, "BadRequest").inc()
            return error_reply(BadRequest(f"{type(exc).__name__}: {exc}"))
        finally:
            self.metrics.requests.labels(label).observe(time.perf_counter() - start)

    def _on_notify(self, client: str, message: bytes) -> None:
        """A write's notification: ``{"op": "commit", "ns", "lease"}`` commits the put whose
        bytes just landed; a refusal fails the client's write with the error's kind."""
        try:
            body = msgpack.unpackb(message, raw=False, strict_map_key=True)
        except Exception as exc:
            raise NotifyRefused(f"BadRequest: not a msgpack map ({exc})") from None
        if not isinstance(body, dict) or body.get("op") != "commit":
            raise NotifyRefused("BadRequest: a notification must be a commit")
        reply = self._handle(client, body)
        if "error" in reply:
            raise NotifyRefused(f"{reply['error']}: {reply['message']}")

    def _namespace(self, body: dict[str, Any]) -> _Namespace:
        handle = message_field(body, "ns", int)
        ns = self._namespaces.get(handle)
        if ns is None:
            raise UnknownNamespace(f"no namespace {handle}: open it first")
        return ns

    def _lease_room(self, client: str) -> None:
        self._sweep()
        if self._owned[client] >= self.config.max_leases_per_client:
            raise TooManyRequests(
                f"{client} holds {self._owned[client]} open leases "
                f"(at most {self.config.max_leases_per_client}): commit or release some"
            )

    def _sweep(self) -> None:
        """Forget leases past their deadline (their slots and pins are already void)."""
        now = time.monotonic()
        for ns in self._namespaces.values():
            for lease_id, (client, staged) in list(ns.stagings.items()):
                if staged.deadline <= now:
                    del ns.stagings[lease_id]
                    self._owned[client] -= 1
                    ns.store.abort(lease_id)
            for lease_id, (client, lease) in list(ns.pins.items()):
                if lease.expired:
                    del ns.pins[lease_id]
                    self._owned[client] -= 1
                    lease.release()

    # -- ops ---------------------------------------------------------------------------

    def _open(self, client: str, body: dict[str, Any]) -> dict[str, Any]:
        name = message_field(body, "namespace", bytes)
        block_bytes = message_field(body, "block_bytes", int)
        if len(name) > MAX_NAMESPACE_BYTES:
            raise BadRequest(f"a namespace is at most {MAX_NAMESPACE_BYTES} bytes")
        if not 0 < block_bytes <= MAX_BLOCK_BYTES:
            raise BadRequest(f"block_bytes must be 1..{MAX_BLOCK_BYTES}, got {block_bytes}")
        handle = self._by_name.get(name)
        if handle is None:
            ns = self._create(name, block_bytes)
        else:
            ns = self._namespaces[handle]
            if ns.store.block_bytes != block_bytes:
                raise BadRequest(
                    f"namespace {ns.label} has {ns.store.block_bytes}-byte blocks, "
                    f"not {block_bytes}"
                )
        top = ns.store.tiers[0]
        assert ns.region is not None
        return {
            "ns": ns.handle,
            "region": ns.region.id,
            "block_bytes": block_bytes,
            "capacity": top.capacity,
            "lease_ttl": self.config.lease_ttl,
        }

    def _create(self, name: bytes, block_bytes: int) -> _Namespace:
        cfg = self.config
        if len(self._namespaces) >= cfg.max_namespaces:
            raise StoreFull(f"the server serves at most {cfg.max_namespaces} namespaces")
        host_share = cfg.host_capacity // cfg.max_namespaces
        if host_share < block_bytes:
            raise StoreFull(f"a namespace's {host_share} bytes of host memory hold no block")
        disk: dict[str, Any] = {}
        if cfg.disk_path is not None:
            digest = hashlib.sha256(name).hexdigest()[:16]
            disk = {
                "disk_path": Path(cfg.disk_path) / f"{digest}-{block_bytes}",
                "disk_capacity": max(cfg.disk_capacity // cfg.max_namespaces, block_bytes),
                "write_through": True,
            }
        store = TieredStore(
            block_bytes,
            host_capacity=host_share,
            namespace=name,
            pin_ttl=cfg.lease_ttl,
            policy=cfg.policy,
            prefault=True,
            **disk,
        )
        handle = len(self._namespaces) + 1
        ns = _Namespace(handle, name, store)
        top = store.tiers[0]
        assert isinstance(top, SlotTier)
        try:
            ns.region = self.engine.register(top.memory.array, access="rw", guard=ns.guard)  # type: ignore[attr-defined]
        except BaseException:
            store.close()
            raise
        with self._lock:
            self._namespaces[handle] = ns
            self._by_name[name] = handle
        return ns

    def _contains(self, client: str, body: dict[str, Any]) -> dict[str, Any]:
        ns = self._namespace(body)
        return {"present": ns.store.contains(keys_field(body))}

    def _match(self, client: str, body: dict[str, Any]) -> dict[str, Any]:
        ns = self._namespace(body)
        return {"count": ns.store.match_prefix(keys_field(body))}

    def _stage(self, client: str, body: dict[str, Any]) -> dict[str, Any]:
        ns = self._namespace(body)
        keys = keys_field(body)
        self._lease_room(client)
        lease, slots = ns.store.stage(keys, ttl=self.config.lease_ttl)
        present = len(keys) - sum(slot is not None for slot in slots)
        saved = present * ns.store.block_bytes
        self.metrics.saved.inc(saved)
        if lease:
            deadline = time.monotonic() + self.config.lease_ttl
            fresh = [k for k, s in zip(keys, slots, strict=True) if s is not None]
            ns.stagings[lease] = (client, _Staged(deadline, fresh))
            self._owned[client] += 1
        return {"lease": lease, "slots": slots, "saved_bytes": saved}

    def _commit(self, client: str, body: dict[str, Any]) -> dict[str, Any]:
        ns = self._namespace(body)
        lease = message_field(body, "lease", int)
        staged: _Staged = self._take(ns.stagings, lease, client)
        stored = ns.store.commit(lease)
        self._hand_off(ns, staged.keys)
        return {"stored": stored}

    def _abort(self, client: str, body: dict[str, Any]) -> dict[str, Any]:
        ns = self._namespace(body)
        lease = message_field(body, "lease", int)
        if ns.stagings.get(lease, ("",))[0] == client:  # else: gone, nothing to give back
            self._take(ns.stagings, lease, client)
            ns.store.abort(lease)
        return {}

    def _pin(self, client: str, body: dict[str, Any]) -> dict[str, Any]:
        ns = self._namespace(body)
        keys = keys_field(body)
        self._lease_room(client)
        lease, slots = ns.store.pin_resident(keys, ttl=self.config.lease_ttl)
        ns.pins[lease.id] = (client, lease)
        self._owned[client] += 1
        self._first_read(ns, keys)
        return {"lease": lease.id, "slots": slots}

    def _release(self, client: str, body: dict[str, Any]) -> dict[str, Any]:
        ns = self._namespace(body)
        lease_id = message_field(body, "lease", int)
        lease = self._take(ns.pins, lease_id, client)
        expired = lease.expired
        lease.release()
        if expired:
            raise LeaseExpired(f"read lease {lease_id} expired before its release")
        return {}

    def _remove(self, client: str, body: dict[str, Any]) -> dict[str, Any]:
        ns = self._namespace(body)
        keys = keys_field(body)
        self._first_read(ns, keys)  # a handoff hold must not make removal fail
        return {"removed": ns.store.remove(keys)}

    def _stats(self, client: str, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            namespaces = list(self._namespaces.values())
        return {
            "server": {
                "address": self.address,
                "uptime_s": time.time() - self._started,
                "transports": list(self.engine.stats()["transports"]),
                "open_leases": sum(self._owned.values()),
            },
            "namespaces": [
                {"handle": ns.handle, "name": ns.label, **ns.store.stats().as_dict()}
                for ns in namespaces
            ],
        }

    def _hand_off(self, ns: _Namespace, keys: list[bytes]) -> None:
        """Hold freshly committed blocks until their first read (or ``handoff_ttl``).

        Prefill pushes a request's blocks and decode pulls them moments later; until then
        nothing says they are wanted, and a policy that evicts never-reused blocks first
        (``reuse``) would drop them first. Their pins go at the first read, at the deadline,
        or oldest first once they would hold more than half of the top tier (so pushes
        alone cannot fill the store with pins)."""
        ttl = min(self.config.handoff_ttl, self.config.lease_ttl)
        fresh = [key for key in keys if key not in ns.unread and ns.store.contains([key])[0]]
        if ttl <= 0 or not fresh:
            return
        ns.store.pin(fresh, ttl=ttl)
        deadline = time.monotonic() + ttl
        for key in fresh:
            ns.unread[key] = deadline
        limit = ns.store.tiers[0].capacity // 2
        while len(ns.unread) > limit:
            self._release_handoff(ns, *ns.unread.popitem(last=False))

    def _first_read(self, ns: _Namespace, keys: list[bytes]) -> None:
        for key in keys:
            deadline = ns.unread.pop(key, None)
            if deadline is not None:
                self._release_handoff(ns, key, deadline)

    @staticmethod
    def _release_handoff(ns: _Namespace, key: bytes, deadline: float) -> None:
        if deadline > time.monotonic():  # an expired pin is gone already: nothing to undo
            ns.store.unpin([key])  # the pin expiring first: handoff_ttl <= lease_ttl

    def _take(self, book: dict[int, Any], lease: int, client: str) -> Any:
        entry = book.get(lease)
        if entry is None or entry[0] != client:
            raise LeaseExpired(f"lease {lease} is unknown, finished or expired")
        del book[lease]
        self._owned[client] -= 1
        return entry[1]

    def _store_stats(self) -> dict[str, StoreStats]:
        with self._lock:
            return {ns.label: ns.store.stats() for ns in self._namespaces.values()}
