"""CacheServer: tiered stores, one per namespace, behind a transfer engine.

Clients reach the server's engine (``StoreClient`` dials ``host:port``); their control
requests ride the engine's authenticated, signed ``call`` channel and run on its call
threads (each session's in order, sessions side by side), each a few store operations under
its namespace's lock, the one lock a request or a remote frame of that namespace takes: no
namespace waits for another's (the locks, their order and the threads: ARCHITECTURE.md). A
pin first reads the blocks that only the disk holds without that lock (``prefetch``), so a
client lifting from disk does not hold up the others. Bytes
never pass through the control path: a client writes blocks straight into staged slots of
the namespace's host slab, and reads pinned slots straight out of it, with the engine.

Put: ``stage`` (slots under a lease) -> the client writes -> ``commit`` (only now visible).
The commit normally rides the data stream as the write's notification: the server commits
on the serve thread once the bytes landed, before the client's write completes, so a put
costs one control round trip. Get: ``pin`` (blocks lifted into host memory, pinned under a
lease) -> the client reads -> ``release``.

Who may do what (the access model, in full in ``docs/ACCESS.md``): every lease belongs to the
session that took it (``Caller.session``: one authenticated handshake); only that session
may commit, abort or release it, write its staged slots or read its pinned ones (the
namespace's region guard), and only a session that opened a namespace may use its handle.
A write is admitted only while its lease is open and holds the slots until its bytes
landed: a lease that ends meanwhile gives its slots back only after that, so late bytes
never land in a reused slot. When a session ends (its streams closed, the client was
killed) its leases end with it. Limits per request and per session keep one client from
taking a namespace's memory (``_namespaces``).

With a disk tier every commit is written through to it: a killed server loses no committed
block, and a restart on the same ``disk_path`` serves them again.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import msgpack

from ..._bounded_log import BoundedLog
from ...transfer import Caller, NotifyRefused, TransferEngine
from .._checksums import as_sums
from .._errors import BlockNotFound, BlockPinned, LeaseExpired, StoreError
from .._keys import BlockKey
from .._lineage import STAGE_LINEAGE_BYTES, check_block_tokens, from_wire, lineage_bytes
from .._stats import StoreStats
from .._stream import MEDIUM
from .._wire import (
    MAX_KEYS_PER_REQUEST,
    BadRequest,
    InternalError,
    NotPermitted,
    TooManyRequests,
    code_of,
    error_reply,
    keys_field,
    optional_field,
)
from .._wire import field as message_field
from ..local._placement import Prefetched
from ._config import ServerConfig, event_bounds
from ._event_ledger import Holder, Quota
from ._events import EventPublisher
from ._lease_counts import LeaseCounts, Reservation
from ._metrics import ServerMetrics, metrics_token
from ._namespace_table import NamespaceTable
from ._namespaces import Namespace
from ._served import Served
from ._snapshots import Snapshots
from ._tenants import Tenant, default_tenant

_log = logging.getLogger("kvbridge.server")
_WRITE_OPS = frozenset({"room", "stage", "commit", "abort", "remove", "clear"})
"""Ops a read-only tenant may not send."""
_QUIET = (BlockNotFound,)  # refusals that are the normal course of things (a cache miss)
_QUICK_OPS = frozenset({"contains", "match", "pin", "release", "abort"})
"""Ops that never touch the disk (a pin only when its blocks are in memory): answered on
the control thread when their namespace's lock is free, saving the hop to a call thread.
Never ``stats``: it reads every store, and a store is locked while a commit writes to disk."""

ServerOp = Callable[[Caller, dict[str, Any]], dict[str, Any]]
"""An op of no namespace (``open``, ``stats``): it takes no namespace's lock."""
NamespaceOp = Callable[[Caller, "Namespace", dict[str, Any]], dict[str, Any]]
"""An op on the namespace the request names, called under that namespace's lock."""


class CacheServer:
    """A standalone KV-block cache: ``CacheServer(config)``, then clients connect to
    ``address``; ``close()`` stops it (also a context manager)."""

    def __init__(
        self, config: ServerConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """``clock`` times leases and handoff holds (tests pass a fake one)."""
        self.config = config or ServerConfig()
        cfg = self.config
        tenants = cfg.tenants or (default_tenant(cfg.secret),)
        self._tenants = {tenant.name: tenant for tenant in tenants}
        self.engine = TransferEngine(
            "kvbridge-server",
            host=cfg.host,
            port=cfg.port,
            transports=cfg.transports,
            principals=[tenant.principal() for tenant in tenants],
            keepalive=cfg.keepalive,
            data_port=cfg.data_port,
        )
        self._counts = LeaseCounts(cfg.max_leases_per_client)
        self._namespaces = NamespaceTable(cfg, self.engine, self._counts, clock)
        self._started = time.time()
        self._refusals = BoundedLog(_log)
        self.metrics = ServerMetrics(
            self._store_stats, lambda: self.engine.stats()["refused"], self._served
        )
        self.metrics_port: int | None = None
        self._events: EventPublisher | None = None
        self._snapshots = Snapshots(clock)
        try:
            if cfg.metrics_port is not None:
                token = None if cfg.secret is None else metrics_token(cfg.secret)
                self.metrics_port = self.metrics.serve(cfg.host, cfg.metrics_port, token=token)
            if cfg.events_port is not None:
                bounds = event_bounds(cfg)
                self._events = EventPublisher(cfg.host, cfg.events_port, clock, bounds=bounds)
        except BaseException:
            self.metrics.close()
            self.engine.close()
            raise
        self.events_port = None if self._events is None else self._events.port
        """Where the namespaces' event streams are published (``docs/EVENTS.md``)."""
        self.address = self.engine.address
        self._server_ops: dict[str, ServerOp] = {"open": self._open, "stats": self._stats}
        self._ns_ops: dict[str, NamespaceOp] = {
            "contains": self._contains,
            "match": self._match,
            "room": self._room_for,
            "stage": self._stage,
            "commit": self._commit,
            "abort": self._abort,
            "pin": self._pin,
            "release": self._release,
            "verify": self._verify,
            "remove": self._remove,
            "clear": self._clear,
            "events": self._subscribe,
            "keys": self._keys,
        }
        self._closed = False
        self.engine.set_request_handler(self._handle, quick=self._quick)
        self.engine.set_notify_handler(self._on_notify)
        self.engine.set_session_end_handler(self._end_session)
        _log.info("serving on %s: %s", self.address, _settings(cfg))

    def close(self) -> None:
        """Stop answering, close every stream, then close the stores (disk synced)."""
        if self._closed:
            return
        self._closed = True
        self.engine.set_session_end_handler(None)
        self.engine.close()  # joins every engine thread: no request is mid-way after this
        self.metrics.close()
        self._namespaces.close()
        if self._events is not None:
            self._events.close()
        _log.info("stopped")

    def __enter__(self) -> CacheServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        return self._server_stats()

    # -- dispatch ----------------------------------------------------------------------

    def _handle(self, caller: Caller, body: dict[str, Any]) -> dict[str, Any]:
        """Answer a request (on a call thread, or the serve thread for a commit)."""
        reply = self._answer(caller, body, wait=True)
        assert reply is not None
        return reply

    def _quick(self, caller: Caller, body: dict[str, Any]) -> dict[str, Any] | None:
        """Answer on the control thread when it costs no wait: an op that never touches
        the disk (a pin only of blocks in memory), with its namespace's lock free at once.
        ``None`` leaves the request to a call thread."""
        if body.get("op") not in _QUICK_OPS:
            return None
        return self._answer(caller, body, wait=False)

    def _answer(self, caller: Caller, body: dict[str, Any], *, wait: bool) -> dict[str, Any] | None:
        op = body.get("op")
        known = isinstance(op, str) and (op in self._server_ops or op in self._ns_ops)
        label = op if known and isinstance(op, str) else "unknown"
        start = time.perf_counter()
        reply: dict[str, Any] | None = None
        try:
            if not known:
                ops = sorted([*self._server_ops, *self._ns_ops])
                raise BadRequest(f"unknown op {op!r}; known: {ops}")
            if op in _WRITE_OPS and self._tenant(caller).read_only:
                raise NotPermitted(f"tenant {self._tenant(caller).label} is read-only: no {op}")
            server_op = self._server_ops.get(label)
            if server_op is not None:
                if not self.engine.session_alive(caller):
                    raise BadRequest(f"session {caller.session} has ended")
                reply = server_op(caller, body)
            else:
                reply = self._in_namespace(caller, label, body, wait=wait)
            return reply
        except StoreError as exc:
            self._refused(caller, label, exc)
            reply = error_reply(exc)
            return reply
        except Exception as exc:  # a bug here, not the client's fault: say so, keep serving
            _log.exception("internal error in %s from session %d", label, caller.session)
            self.metrics.errors.labels(label, "InternalError").inc()
            reply = error_reply(InternalError(f"{type(exc).__name__} in {label}"))
            return reply
        finally:
            if reply is not None:
                self.metrics.requests.labels(label).observe(time.perf_counter() - start)

    def _in_namespace(
        self, caller: Caller, op: str, body: dict[str, Any], *, wait: bool
    ) -> dict[str, Any] | None:
        """Run ``op`` under its namespace's lock; ``None`` when ``wait`` is false and the
        lock is taken, or a pin finds blocks that are not in memory."""
        ns = self._namespace(caller, body)
        handler = self._ns_ops[op]
        if op == "pin" and wait:  # disk reads first, outside the namespace's lock
            handler = functools.partial(self._pin, early=self._prefetch(ns, body))
        if not ns.lock.acquire(blocking=wait):
            return None
        try:
            # Checked under the namespace's lock: a session that ends after this is cleaned
            # up after this request (_end_session waits for the lock), never before; a
            # namespace reclaimed since it was looked up has no openers.
            if not self.engine.session_alive(caller):
                raise BadRequest(f"session {caller.session} has ended")
            self._namespaces.check_opener(caller, ns)
            ns.leases.sweep()  # leases past their deadline end before anything else
            if op == "pin" and not wait and not _in_memory(ns, body):
                return None
            return handler(caller, ns, body)
        finally:
            ns.lock.release()

    def _refused(self, caller: Caller, op: str, exc: StoreError) -> None:
        """Count a refused request; log it at a bounded rate per op and kind (a client may
        send refused requests as fast as it likes)."""
        kind = type(exc).__name__
        self.metrics.errors.labels(op, kind).inc()
        level = logging.DEBUG if isinstance(exc, _QUIET) else logging.INFO
        message = "refused %s from session %d: %s: %s"
        self._refusals.refused(f"{op}/{kind}", level, message, op, caller.session, kind, exc)

    def _on_notify(self, caller: Caller, message: bytes) -> None:
        """A write's notification: ``{"op": "commit", "ns", "lease"}`` commits the put whose
        bytes just landed; a refusal fails the client's write with the error's code."""
        try:
            body = msgpack.unpackb(message, raw=False, strict_map_key=True)
        except Exception as exc:
            body = None
            error: StoreError = BadRequest(f"a notification must be a msgpack map ({exc})")
        else:
            error = BadRequest("a notification must be a commit")
        if not isinstance(body, dict) or body.get("op") != "commit":
            self._refused(caller, "commit", error)
            raise NotifyRefused(str(error), code_of(error))
        reply = self._handle(caller, body)
        if "error" in reply:
            raise NotifyRefused(f"{reply['kind']}: {reply['message']}", reply["error"])

    def _end_session(self, caller: Caller) -> None:
        """A client's session ended (it closed, or was killed): its leases end now, each
        namespace's under its lock (a request of the session that holds one is answered
        first; one that comes after finds the session ended)."""
        for ns in self._namespaces.snapshot():
            # Only the namespaces it opened (a session with none, as a dial's probe, takes
            # no lock: it runs on the control thread). Openers are added under the table's
            # lock with the session alive, and the snapshot is taken after it ended.
            if caller.session in ns.openers:
                with ns.lock:
                    ns.end_session(caller.session)
        self._snapshots.drop(caller.session)
        _log.debug("session %d (%s) ended", caller.session, caller.peer)

    def _namespace(self, caller: Caller, body: dict[str, Any]) -> Namespace:
        return self._namespaces.get(caller, message_field(body, "ns", int))

    def _tenant(self, caller: Caller) -> Tenant:
        """The tenant a session proved at its handshake (the engine admits no other)."""
        return self._tenants[caller.principal]

    def _reserved(self, caller: Caller, ns: Namespace, blocks: int) -> Reservation:
        """A lease of ``blocks`` slots counted for ``caller`` (keep it once the lease
        opens), or TooManyRequests when it would take more than a share: the session's or
        its tenant's open leases over every namespace (``_lease_counts``), then its slots
        of this namespace."""
        tenant = self._tenant(caller)
        try:
            reservation = self._counts.reserve(caller.session, tenant)
        except TooManyRequests:  # leases past their deadline elsewhere count no more
            self._sweep_others(ns)
            reservation = self._counts.reserve(caller.session, tenant)
        try:
            self._check_slots(caller, tenant, ns, blocks)
        except BaseException:
            reservation.cancel()
            raise
        return reservation

    def _sweep_others(self, ns: Namespace) -> None:
        """End the leases past their deadline in every namespace but ``ns`` (whose lock the
        request holds) whose lock is free at once: a quiet namespace sweeps nothing by
        itself, and its expired leases would count against their session and tenant in
        every namespace. A busy one is not waited for: its op swept it as it began."""
        for other in self._namespaces.snapshot():  # the table's lock never waits for ours
            if other is ns or not other.lock.acquire(blocking=False):
                continue
            try:
                other.leases.sweep()
            finally:
                other.lock.release()

    def _check_slots(self, caller: Caller, tenant: Tenant, ns: Namespace, blocks: int) -> None:
        """A request's slots within its share of ``ns``: one request's, the session's, and
        (every session of it together: more sessions gain nothing) the tenant's."""
        if blocks > ns.request_blocks:
            raise TooManyRequests(
                f"{blocks} blocks in one request; at most {ns.request_blocks} in {ns.label}"
            )
        held = ns.leases.held[caller.session]
        if held + blocks > ns.session_blocks:
            raise TooManyRequests(
                f"session {caller.session} holds {held} slots of {ns.label}; with {blocks} "
                f"more it would pass its share of {ns.session_blocks}: release some first"
            )
        share = int(ns.slots * tenant.slots)
        held = ns.leases.tenant_held(tenant.name)  # its pushes' handoff holds too
        if tenant.slots < 1 and held + blocks > share:
            raise TooManyRequests(
                f"tenant {tenant.label} holds {held} slots of {ns.label}; with {blocks} more "
                f"it would pass its share of {share}: release some first"
            )

    # -- ops ---------------------------------------------------------------------------

    def _open(self, caller: Caller, body: dict[str, Any]) -> dict[str, Any]:
        name = message_field(body, "namespace", bytes)
        block_bytes = message_field(body, "block_bytes", int)
        block_tokens = check_block_tokens(optional_field(body, "block_tokens", int) or 0)
        tenant = self._tenant(caller)
        if not tenant.may_open(name):
            raise NotPermitted(f"tenant {tenant.label} may not open this namespace")
        ns = self._namespaces.open(
            caller,
            name,
            block_bytes,
            tenant,
            alive=lambda: self.engine.session_alive(caller),
            block_tokens=block_tokens,
        )
        assert ns.region is not None
        return {
            "ns": ns.handle,
            "region": ns.region.id,
            "block_bytes": block_bytes,
            "block_tokens": ns.block_tokens,
            "capacity": ns.slots,
            "lease_ttl": self.config.lease_ttl,
            "request_blocks": ns.request_blocks,
        }

    def _contains(self, caller: Caller, ns: Namespace, body: dict[str, Any]) -> dict[str, Any]:
        present = ns.store.contains(keys_field(body))
        ns.served.looked_up(sum(present))
        return {"present": present}

    def _match(self, caller: Caller, ns: Namespace, body: dict[str, Any]) -> dict[str, Any]:
        count = ns.store.match_prefix(keys_field(body))
        ns.served.looked_up(count)
        return {"count": count}

    def _room_for(self, caller: Caller, ns: Namespace, body: dict[str, Any]) -> dict[str, Any]:
        """How many of the keys are new and how many new blocks fit beside the stored ones;
        with ``put``, a put of several requests: its keys are kept from eviction by its
        own stagings (``_puts``), when they fit."""
        keys, put, ttl = keys_field(body), _put_id(body), self.config.lease_ttl
        new, room = ns.leases.room_for(caller.session, caller.principal, keys, put, ttl)
        return {"new": new, "room": room}

    def _stage(self, caller: Caller, ns: Namespace, body: dict[str, Any]) -> dict[str, Any]:
        keys = keys_field(body)
        put, last = _put_id(body), optional_field(body, "last", bool)
        sent = body.get("lineage")
        lineage = () if sent is None else from_wire(sent, len(keys), ns.block_tokens)
        ttl = self.config.lease_ttl
        protect = ns.leases.protect(caller.session, put, bool(last), ttl)
        if not keys:
            return {"lease": 0, "slots": [], "saved_bytes": 0}
        with self._reserved(caller, ns, len(keys)) as reservation:
            lease, slots = ns.leases.stage(
                caller.session, caller.principal, keys, ttl, protect=protect, lineage=lineage
            )
            if lease:  # else every block was stored already: no lease, nothing counted
                reservation.keep()
        saved = (len(keys) - sum(slot is not None for slot in slots)) * ns.store.block_bytes
        self.metrics.saved.inc(saved)
        return {"lease": lease, "slots": slots, "saved_bytes": saved}

    def _commit(self, caller: Caller, ns: Namespace, body: dict[str, Any]) -> dict[str, Any]:
        lease = message_field(body, "lease", int)
        ttl = min(self.config.handoff_ttl, self.config.lease_ttl)
        share = self._tenant(caller).slots
        sums = as_sums(body.get("sums", []))  # their count: the ledger's to check
        if sums is None:
            raise BadRequest("sums must be a list of 64-bit checksums, one per staged block")
        stored = ns.leases.commit(
            caller.session, lease, handoff_ttl=ttl, share=share, checksums=sums
        )
        ns.served.stored(stored * ns.store.block_bytes)
        return {"stored": stored}

    def _abort(self, caller: Caller, ns: Namespace, body: dict[str, Any]) -> dict[str, Any]:
        ns.leases.abort(caller.session, message_field(body, "lease", int))
        return {}

    def _prefetch(self, ns: Namespace, body: dict[str, Any]) -> Prefetched | None:
        """A pin's blocks that only the disk holds, read without the namespace's lock (a
        hint: ``None`` when the request is bad, the locked pin then says why)."""
        try:
            keys = keys_field(body)
            return ns.leases.prefetch(keys) if len(keys) <= ns.request_blocks else None
        except StoreError:
            return None

    def _pin(
        self,
        caller: Caller,
        ns: Namespace,
        body: dict[str, Any],
        early: Prefetched | None = None,
    ) -> dict[str, Any]:
        keys = keys_field(body)
        if not keys:
            return {"lease": 0, "slots": []}  # nothing to read: no lease to count
        ttl = self.config.lease_ttl
        with self._reserved(caller, ns, len(keys)) as reservation:
            try:
                lease, slots = ns.leases.pin(caller.session, caller.principal, keys, ttl, early)
            except BlockNotFound as exc:
                ns.served.missed("gone", len(exc.keys))
                raise
            reservation.keep()
        ns.served.served(len(keys))
        return {"lease": lease, "slots": slots, "sums": ns.leases.checksums(keys)}

    def _verify(self, caller: Caller, ns: Namespace, body: dict[str, Any]) -> dict[str, Any]:
        """A reader's report of blocks that failed their checksum once landed: each stored
        copy is checked again here, and a bad one dropped (a reader cannot make the server
        drop a good block)."""
        keys = keys_field(body)
        if len(keys) > ns.request_blocks:
            raise BadRequest(f"{len(keys)} keys to verify; at most {ns.request_blocks}")
        dropped = ns.store.verify(keys)
        stored = sum(dropped)
        ns.served.missed("corrupt", stored)
        ns.served.missed("transfer", len(keys) - stored)
        _log.warning(
            "namespace %s: a reader found %d block(s) corrupt; %d bad in the store (dropped), "
            "%d went bad on the way",
            ns.label,
            len(keys),
            stored,
            len(keys) - stored,
        )
        return {"dropped": dropped}

    def _release(self, caller: Caller, ns: Namespace, body: dict[str, Any]) -> dict[str, Any]:
        try:
            ns.leases.release(caller.session, message_field(body, "lease", int))
        except LeaseExpired:
            ns.served.missed("lease", 1)  # a read, its blocks no longer known here
            raise
        return {}

    def _remove(self, caller: Caller, ns: Namespace, body: dict[str, Any]) -> dict[str, Any]:
        keys = keys_field(body)
        holds = ns.leases.holds.take(keys)  # a handoff hold must not make removal fail
        try:
            return {"removed": ns.store.remove(keys)}
        except BlockPinned:  # refused: the holds it released come back, nothing changed
            ns.leases.holds.restore(holds)
            raise

    def _clear(self, caller: Caller, ns: Namespace, body: dict[str, Any]) -> dict[str, Any]:
        """Every block of the namespace that no reader has pinned; handoff holds end."""
        ns.leases.holds.take(ns.leases.holds.keys())
        return {"removed": ns.store.clear()}

    def _subscribe(self, caller: Caller, ns: Namespace, body: dict[str, Any]) -> dict[str, Any]:
        """A ticket to the namespace's event stream (``_events``): only a session that
        opened the namespace gets one, and it subscribes one connection, once. It counts
        against the session's and its tenant's caps (``_event_ledger``), until the
        subscriber it became is gone: ``TooManyRequests`` past one."""
        if self._events is None:
            raise BadRequest("this server publishes no events (kvbridge serve --events-port)")
        stream = ns.events(self._events)
        tenant = self._tenant(caller)
        holder = Holder(caller.session, tenant.name)
        ticket = stream.ticket(holder, Quota(tenant.max_tickets, tenant.max_subscribers))
        return {"port": self._events.port, "topic": stream.topic, "ticket": ticket}

    def _keys(self, caller: Caller, ns: Namespace, body: dict[str, Any]) -> dict[str, Any]:
        """A page of a snapshot of the namespace's keys (``_snapshots``): without
        ``snapshot`` the first page of a new one, with it the page at ``offset``; with
        ``lineage``, each key's lineage beside it (``nil``: none kept) and the medium it is
        in now (``nil``: it left since the snapshot was taken)."""
        sid = optional_field(body, "snapshot", int)
        offset = optional_field(body, "offset", int) or 0
        lineage = bool(optional_field(body, "lineage", bool))
        if sid is None:
            self._snapshots.check_room(caller.session)
            seq = 0 if ns.stream is None else ns.stream.seq  # read before the keys: see there
            sid = self._snapshots.take(caller.session, ns.handle, seq, ns.store.keys())
        snap = self._snapshots.page(caller.session, ns.handle, sid)
        if offset < 0:
            raise BadRequest(f"offset {offset} is negative")
        end = offset + _page_keys(ns.block_tokens if lineage else 0)
        page, more = snap.keys[offset:end], end < len(snap.keys)
        reply = {"snapshot": sid, "seq": snap.seq, "keys": page, "more": more}
        if lineage:
            entries = [ns.lineage.get(BlockKey(key)) for key in page]
            reply["lineage"] = [None if entry is None else entry.wire() for entry in entries]
            tiers = ns.store.where([BlockKey(key) for key in page])
            reply["media"] = [None if t is None else MEDIUM.get(t, t.upper()) for t in tiers]
        return reply

    def _stats(self, caller: Caller, body: dict[str, Any]) -> dict[str, Any]:
        """Server figures. A namespace this session has not opened is named by a digest of
        its name, and one its tenant may not open is not listed at all: other tenants'
        namespaces are not every client's business."""
        return self._server_stats(caller.session, self._tenant(caller))

    def _server_stats(
        self, session: int | None = None, tenant: Tenant | None = None
    ) -> dict[str, Any]:
        """Every namespace's figures; with ``session``, names hidden where it is not open,
        with ``tenant`` only the namespaces it may open."""
        namespaces = [
            ns for ns in self._namespaces.snapshot() if tenant is None or tenant.may_open(ns.name)
        ]
        return {
            "server": {
                "address": self.address,
                "uptime_s": time.time() - self._started,
                "transports": list(self.engine.stats()["transports"]),
                "open_leases": sum(len(ns.leases) for ns in namespaces),
            },
            "namespaces": [
                {
                    "handle": ns.handle,
                    "name": ns.label if session is None or session in ns.openers else ns.anonymous,
                    **ns.store.stats().as_dict(),
                    "served": ns.served.as_dict(),
                }
                for ns in namespaces
            ],
        }

    def _served(self) -> dict[str, Served]:
        return {ns.label: ns.served for ns in self._namespaces.snapshot()}

    def _store_stats(self) -> dict[str, StoreStats]:
        return {ns.label: ns.store.stats() for ns in self._namespaces.snapshot()}


def _in_memory(ns: Namespace, body: dict[str, Any]) -> bool:
    """Whether every block a pin names is in the namespace's top (memory) tier now."""
    top = ns.store.tiers[0].index
    return all(key in top for key in keys_field(body))


def _page_keys(block_tokens: int) -> int:
    """Keys in one page of a snapshot: with lineage of ``block_tokens`` token ids each, as
    many as fit a control message as a ``stage`` request's do."""
    if not block_tokens:
        return MAX_KEYS_PER_REQUEST
    return max(1, min(MAX_KEYS_PER_REQUEST, STAGE_LINEAGE_BYTES // lineage_bytes(block_tokens)))


def _put_id(body: dict[str, Any]) -> int | None:
    """The ``put`` a request belongs to (a put of several requests), if it names one."""
    put: int | None = optional_field(body, "put", int)
    return put


def _settings(cfg: ServerConfig) -> str:
    """The settings as one log line, the secret left out (only whether there is one)."""
    shown = {k: v for k, v in vars(cfg).items() if k not in ("secret", "tenants")}
    shown["secret"] = "set" if cfg.secret is not None else "none"
    if cfg.tenants is not None:  # their names, never their secrets
        shown["tenants"] = "/".join(tenant.name for tenant in cfg.tenants)
    return ", ".join(f"{k}={v}" for k, v in shown.items())
