"""Cluster membership in etcd: a server's record under a lease, and a client's live view.

A server's :class:`Registrar` puts its record (``<prefix><name>`` -> JSON) under a lease of
a few seconds and keeps the lease alive on its own thread; if etcd forgot the lease (etcd
was down longer than the TTL, or replaced) it grants a new one and puts the record again.
``stop()`` revokes the lease: the record goes at once. A server killed without stopping
leaves its record until the lease expires.

A client's :class:`Membership` lists the prefix, then watches it from the next revision;
when etcd is away it keeps the members it last saw (stale but working, with a warning) and
lists again once etcd answers (a replaced etcd restarts its revisions, so a watch resumed
from the old revision would miss records). A record that does not parse is skipped with a
warning.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ._etcd import EtcdError, EtcdGateway, EtcdUnavailable, Watch, WatchCompacted, WatchIdle

__all__ = ["Member", "Membership", "Registrar"]

_log = logging.getLogger("kvbridge.cluster")


@dataclass(frozen=True)
class Member:
    """One server as its record describes it."""

    name: str
    address: str
    """``host:port`` a ``StoreClient`` connects to."""
    capacity: int = 0
    """Host-memory bytes."""

    def to_record(self) -> bytes:
        return json.dumps(
            {"name": self.name, "address": self.address, "capacity": self.capacity}
        ).encode()

    @classmethod
    def from_record(cls, data: bytes) -> Member:
        """Raises ``ValueError`` for a record that is not one of ours (whatever is in it:
        etcd's contents are not ours to trust)."""
        try:
            if len(data) > MAX_RECORD_BYTES:
                raise ValueError("too long")
            fields = json.loads(data)
            member = cls(fields["name"], fields["address"], fields["capacity"])
        except Exception as exc:  # json and field access raise many kinds (deep nesting...)
            raise ValueError(f"not a member record: {data[:80]!r}") from exc
        if not (
            _word(member.name)
            and _word(member.address)
            and ":" in member.address
            and isinstance(member.capacity, int)
            and not isinstance(member.capacity, bool)
            and 0 <= member.capacity < 2**63
        ):
            raise ValueError(f"not a member record: {data[:80]!r}")
        return member


MAX_RECORD_BYTES = 4096
"""A member record is a small JSON map; anything longer is not one."""


def _word(value: object) -> bool:
    """A printable ASCII string without spaces, at most 256 characters (names, addresses)."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= 256
        and value.isascii()
        and value.isprintable()
        and " " not in value
    )


class Registrar:
    """Keeps ``key`` -> ``record`` alive in etcd under a lease of ``ttl`` seconds."""

    def __init__(self, gateway: EtcdGateway, key: bytes, record: bytes, ttl: int = 3) -> None:
        self._gateway = gateway
        self._key = key
        self._record = record
        self._ttl = ttl
        self._lease = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvbridge-etcd-lease", daemon=True)

    def start(self) -> None:
        """Register once now (raises :class:`EtcdUnavailable` if etcd cannot be reached),
        then keep the lease alive on the registrar's thread."""
        self._register()
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, then revoke the lease (the record goes); if etcd is away the
        lease expires by itself."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self._lease:
            try:
                self._gateway.lease_revoke(self._lease)
            except (EtcdUnavailable, EtcdError) as exc:
                _log.warning("could not deregister from %r: %s", self._gateway, exc)
            self._lease = 0

    def _register(self) -> None:
        self._lease = self._gateway.lease_grant(self._ttl)
        self._gateway.put(self._key, self._record, lease=self._lease)

    def _run(self) -> None:
        while not self._stop.wait(self._ttl / 3):
            try:
                if not self._lease or self._gateway.lease_keepalive(self._lease) == 0:
                    self._register()
                    _log.info("registered again in %r (the old lease was gone)", self._gateway)
            except EtcdError as exc:
                _log.warning("etcd refused the lease: %s; registering again", exc)
                self._lease = 0
            except EtcdUnavailable as exc:
                _log.warning("cannot reach etcd: %s; still serving", exc)


class Membership:
    """The members under ``prefix``, kept current from etcd on the view's own thread."""

    def __init__(
        self,
        gateway: EtcdGateway,
        prefix: bytes,
        on_change: Callable[[dict[str, Member]], None] | None = None,
        retry_s: float = 1.0,
    ) -> None:
        self._gateway = gateway
        self._prefix = prefix
        self._on_change = on_change
        self._retry_s = retry_s
        self._records: dict[bytes, bytes] = {}
        self._members: dict[str, Member] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watch: Watch | None = None
        self._stale = False
        self._next = 0  # the revision to watch from; 0: list first
        self._warned: dict[bytes, bytes] = {}  # bad records already logged
        self._thread = threading.Thread(target=self._run, name="kvbridge-etcd-watch", daemon=True)

    def start(self) -> None:
        """List once now (raises :class:`EtcdUnavailable` if etcd cannot be reached), then
        keep watching on the view's thread."""
        self._next = self._list()
        self._thread.start()

    def members(self) -> dict[str, Member]:
        with self._lock:
            return dict(self._members)

    @property
    def stale(self) -> bool:
        """Whether etcd stopped answering: ``members()`` is then what it said last."""
        return self._stale

    def stop(self) -> None:
        self._stop.set()
        watch = self._watch
        if watch is not None:
            watch.cancel()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._next:
                    self._next = self._list()
                if self._stale:
                    _log.warning("etcd %r answers again: membership is current", self._gateway)
                    self._stale = False
                self._watch = self._gateway.watch_prefix(self._prefix, self._next, self._event)
                if self._stop.is_set():
                    return
                self._watch.run()
            except (WatchCompacted, WatchIdle):  # list again, quietly
                self._next = 0
            except (EtcdUnavailable, EtcdError) as exc:
                if not self._stale:
                    _log.warning(
                        "etcd %r: %s; using the %d members seen last until it answers",
                        *(self._gateway, exc, len(self._members)),
                    )
                self._stale = True
                self._next = 0  # a replaced etcd restarts its revisions: list again first
                self._stop.wait(self._retry_s)

    def _list(self) -> int:
        revision, records = self._gateway.get_prefix(self._prefix)
        with self._lock:
            self._records = records
        self._publish()
        return revision + 1

    def _event(self, kind: str, key: bytes, value: bytes) -> None:
        with self._lock:
            if kind == "DELETE":
                self._records.pop(key, None)
            else:
                self._records[key] = value
        self._publish()

    def _publish(self) -> None:
        members: dict[str, Member] = {}
        with self._lock:
            records = dict(self._records)
        for key, data in records.items():
            try:
                member = Member.from_record(data)
            except ValueError as exc:
                if self._warned.get(key) != data:  # once per bad record, not per event
                    self._warned[key] = data
                    _log.warning("skipping %r: %s", key[:200], exc)
                continue
            members[member.name] = member
        with self._lock:
            changed = members != self._members
            self._members = members
        if changed and self._on_change is not None:
            self._on_change(members)
