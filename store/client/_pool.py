"""ClientPool: the ``StoreClient`` connections of a connector (one server, several clients,
so that a lookup never waits behind a large save) and of a cluster client (one per member),
with one rule for a client whose server failed."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

from ...transfer import PeerClosed
from .._errors import StoreClosed, StoreError
from ._client import SERVER_FAULTS, StoreClient

__all__ = ["ClientPool", "Lent"]

_log = logging.getLogger("kvbridge.client")


class Lent(NamedTuple):
    """A client lent by :meth:`ClientPool.lease`, and what ``prepare`` made for it."""

    client: StoreClient
    prepared: Any


class _Slot:
    """One client of one server: its caller one at a time (the lock), made on first use."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.client: StoreClient | None = None
        self.prepared: Any = None
        self.retired = False

    def close(self, address: str) -> None:
        """Close the client (the caller holds the lock, or gave up waiting for it)."""
        client, self.client = self.client, None
        if client is None:
            return
        try:
            client.close()
        except (StoreError, *SERVER_FAULTS) as exc:
            _log.debug("closing a client of %s: %s", address, exc)


class ClientPool:
    """``StoreClient``\\ s by server address, ``per_server`` each, made on first use with
    ``settings`` (``StoreClient``'s keyword arguments; ``timeout`` among them).

    A client serves one caller at a time: :meth:`lease` lends a free one (else waits, at
    most ``timeout``, for the one whose turn it is: ``TimeoutError``) and bounds the block
    to ``timeout`` in all (``StoreClient.deadline``). A fault on a lent client
    (:data:`SERVER_FAULTS`) retires it before its lock is released: it is closed, a caller
    that waited for it gets ``PeerClosed`` at once (it does not spend a timeout of its own
    on the same dead server; behind a failed call that cost a cluster reader 6.0 s, two
    timeouts), and the next lease makes a fresh client. ``prepare(client)`` (see
    :meth:`prepare`) runs on every client, made now or later: registering an engine's memory.
    """

    def __init__(self, *, per_server: int = 1, **settings: Any) -> None:
        if isinstance(per_server, bool) or not isinstance(per_server, int) or per_server < 1:
            raise ValueError(f"per_server must be a positive int, got {per_server!r}")
        self._per_server = per_server
        self._settings = settings
        self._timeout: float = settings.get("timeout", 30.0)
        self._slots: dict[str, list[_Slot]] = {}
        self._prepare: Callable[[StoreClient], Any] | None = None
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._closed = False

    def connect(self, address: str) -> None:
        """Make every client of ``address`` now (a server that cannot be reached raises
        here, not at the first lease)."""
        for index in range(self._per_server):
            with self._holding(address, index) as slot:
                self._ready(address, slot)

    @contextlib.contextmanager
    def lease(self, address: str, *, first: bool = False) -> Iterator[Lent]:
        """A client of ``address`` for the block; ``first``: always the same one (a lease
        on the server belongs to the session that took it)."""
        with self._holding(address, 0 if first else None) as slot:
            if slot.retired:
                raise PeerClosed(f"{address}: its client failed or was dropped")
            try:
                client = self._ready(address, slot)
                with client.deadline(self._timeout):
                    yield Lent(client, slot.prepared)
            except SERVER_FAULTS:
                self._retire(address, slot)
                raise

    def prepare(self, fn: Callable[[StoreClient], Any]) -> None:
        """Run ``fn`` on every client made so far (each when it is free) and on each made
        later; a lease yields its result as ``Lent.prepared``."""
        self._prepare = fn
        with self._lock:
            made = [(a, i) for a, slots in self._slots.items() for i, s in enumerate(slots)]
        for address, index in made:
            with self._holding(address, index) as slot:
                if slot.client is not None:
                    slot.prepared = fn(slot.client)

    def drop(self, address: str) -> None:
        """Close the clients of ``address`` (each once its call in flight ended, or its
        timeout passed); a later lease makes new ones."""
        with self._lock:
            slots = self._slots.pop(address, [])
        for slot in slots:
            slot.retired = True
            held = slot.lock.acquire(timeout=self._timeout)
            try:
                slot.close(address)
            finally:
                if held:
                    slot.lock.release()

    def forget(self, keep: set[str]) -> None:
        """Drop the clients of every server not in ``keep``."""
        with self._lock:
            gone = [address for address in self._slots if address not in keep]
        for address in gone:
            self.drop(address)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            addresses = list(self._slots)
        for address in addresses:
            self.drop(address)

    # -- plumbing ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _holding(self, address: str, index: int | None) -> Iterator[_Slot]:
        """The slot of ``address`` at ``index`` (any free one when ``None``), locked."""
        slots = self._slots_of(address)
        slot = None
        if index is None:
            slot = next((s for s in slots if s.lock.acquire(blocking=False)), None)
            index = next(self._turn) % len(slots)
        if slot is None:
            slot = slots[index]
            if not slot.lock.acquire(timeout=self._timeout):
                raise TimeoutError(f"{address}: every client busy past {self._timeout} s")
        try:
            yield slot
        finally:
            slot.lock.release()

    def _slots_of(self, address: str) -> list[_Slot]:
        with self._lock:
            if self._closed:
                raise StoreClosed("the client pool is closed")
            return self._slots.setdefault(address, [_Slot() for _ in range(self._per_server)])

    def _ready(self, address: str, slot: _Slot) -> StoreClient:
        if slot.client is None:
            slot.client = StoreClient(address, **self._settings)
            if self._prepare is not None:
                slot.prepared = self._prepare(slot.client)
        return slot.client

    def _retire(self, address: str, slot: _Slot) -> None:
        """``slot`` (locked by the caller) failed: closed now, replaced for later leases."""
        slot.retired = True
        slot.close(address)
        with self._lock:
            slots = self._slots.get(address)
            if slots is not None and slot in slots:
                slots[slots.index(slot)] = _Slot()
