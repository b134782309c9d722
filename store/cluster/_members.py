"""A ``ClusterClient``'s connections: one ``StoreClient`` per member, made on first use."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ...transfer import TransferError
from .._errors import StoreError

__all__ = ["FAULTS", "Connector"]

_log = logging.getLogger("kvbridge.cluster")
_T = TypeVar("_T")

FAULTS = (TransferError, OSError, EOFError, TimeoutError)
"""What a member's failure looks like to its client (a refusal is a StoreError instead)."""


class _Entry:
    """One member's client: its calls one at a time, closed once dropped and unused."""

    def __init__(self) -> None:
        self.client: Any = None
        self.lock = threading.Lock()
        self.users = 0
        self.retired = False


class Connector:
    """One ``StoreClient`` per member, made on first use, one call at a time each. A member
    dropped while another thread's call is on it is closed when that call returns."""

    def __init__(self, **settings: Any) -> None:
        self._settings = settings  # StoreClient's keyword arguments
        self._clients: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def call(self, address: str, fn: Callable[[Any], _T]) -> _T:
        from ..client._client import StoreClient  # noqa: PLC0415 - the client loads the engine

        with self._lock:
            entry = self._clients.setdefault(address, _Entry())
            entry.users += 1
        try:
            # Another thread's call may be stuck on a dead member: wait for it at most one
            # timeout (then this call fails over too), and not at all once it was dropped.
            if not entry.lock.acquire(timeout=self._settings["timeout"]):
                raise TimeoutError(f"{address}: busy past the timeout")
            try:
                if entry.retired:
                    raise EOFError(f"{address} was dropped")
                if entry.client is None:
                    entry.client = StoreClient(address, **self._settings)
                try:
                    return fn(entry.client)
                except FAULTS:
                    self._retire(address, entry)  # before the next caller gets the lock
                    raise
            finally:
                entry.lock.release()
        finally:
            with self._lock:
                entry.users -= 1
                last = entry.retired and entry.users == 0
            if last:
                _close(address, entry.client)

    def drop(self, address: str) -> None:
        with self._lock:
            entry = self._clients.pop(address, None)
            if entry is None:
                return
            entry.retired = True
            unused = entry.users == 0
        if unused:
            _close(address, entry.client)

    def _retire(self, address: str, entry: _Entry) -> None:
        """A call on ``entry`` failed: a thread waiting for it fails over at once instead
        of spending its own timeout on the same dead member (a member killed mid-call
        cost a reader 6 s, two timeouts, without this)."""
        with self._lock:
            entry.retired = True
            if self._clients.get(address) is entry:
                del self._clients[address]

    def forget(self, listed: set[str]) -> None:
        """Close the clients of members etcd no longer lists."""
        with self._lock:
            gone = [a for a in self._clients if a not in listed]
        for address in gone:
            self.drop(address)

    def close(self) -> None:
        with self._lock:
            addresses = list(self._clients)
        for address in addresses:
            self.drop(address)


def _close(address: str, client: Any) -> None:
    if client is None:
        return
    try:
        client.close()
    except (StoreError, *FAULTS) as exc:
        _log.debug("closing the client of %s: %s", address, exc)
