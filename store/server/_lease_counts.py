"""Open leases per session and per tenant, across every namespace of a server.

The bounds that span namespaces (a session's ``max_leases_per_client``, a tenant's
``max_leases``) are the only lease state one namespace's requests share with another's, so
they live here, under a lock of their own that is held for a count and nothing else: a
request takes its namespace's lock, then (for a moment) this one, never the reverse.

A request that may open a lease first :meth:`LeaseCounts.reserve` s one (refused when a bound
is reached); the reservation is kept when the lease opens and given back otherwise. The
namespace's lease ledger gives a kept one back when its lease ends (:meth:`LeaseCounts.give`).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import TypeVar

from .._wire import TooManyRequests
from ._tenants import Tenant

_Who = TypeVar("_Who", int, str)


class LeaseCounts:
    """Open leases per session and per tenant (by name), every namespace together."""

    def __init__(self, per_session: int) -> None:
        self._per_session = per_session
        self._lock = threading.Lock()
        self._sessions: Counter[int] = Counter()
        self._tenants: Counter[str] = Counter()

    def reserve(self, session: int, tenant: Tenant) -> Reservation:
        """One more lease for ``session`` of ``tenant``, or :class:`TooManyRequests` when
        the session holds ``per_session`` already, or the tenant its ``max_leases``.
        Counted at once: two requests never both take the last."""
        with self._lock:
            held = self._sessions[session]
            if held >= self._per_session:
                raise TooManyRequests(
                    f"session {session} holds {held} open leases "
                    f"(at most {self._per_session}): commit or release some"
                )
            of_tenant = self._tenants[tenant.name]
            if tenant.max_leases is not None and of_tenant >= tenant.max_leases:
                raise TooManyRequests(
                    f"tenant {tenant.label} holds {of_tenant} open leases "
                    f"(at most {tenant.max_leases}): commit or release some"
                )
            self._sessions[session] += 1
            self._tenants[tenant.name] += 1
        return Reservation(self, session, tenant.name)

    def give(self, session: int, tenant: str) -> None:
        """A lease of ``session`` of ``tenant`` ended (or its reservation was not kept)."""
        with self._lock:
            _take(self._sessions, session)
            _take(self._tenants, tenant)


class Reservation:
    """One lease counted ahead of its opening: :meth:`keep` it once the lease opened (its
    end gives it back), or leave the ``with`` block without, which gives it back now."""

    def __init__(self, counts: LeaseCounts, session: int, tenant: str) -> None:
        self._counts = counts
        self._session = session
        self._tenant = tenant
        self._kept = False

    def keep(self) -> None:
        self._kept = True

    def cancel(self) -> None:
        """Give it back now, unless it was kept."""
        if not self._kept:
            self._kept = True  # once
            self._counts.give(self._session, self._tenant)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


def _take(counter: Counter[_Who], who: _Who) -> None:
    counter[who] -= 1
    if counter[who] <= 0:
        del counter[who]
