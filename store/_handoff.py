"""Handoff holds: freshly committed blocks kept for their first read.

Prefill pushes a request's blocks and decode pulls them moments later; until then nothing
says they are wanted, and a policy that evicts never-reused blocks first (``reuse``) would
drop them first. So a commit pins its new blocks for ``ttl`` seconds; the pin goes at the
first read, at the deadline, or oldest first once holds would fill more than half of the
namespace's memory (so pushes alone cannot fill it with pins), or more than the committing
tenant's share of that half (so one tenant's pushes cannot take what another's leave). A
tenant's holds count against its share of the namespace (``CacheServer._tenant_room``).
The server calls these under its state lock.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._namespaces import Hold, Namespace


def hand_off(
    ns: Namespace, keys: Sequence[bytes], ttl: float, principal: str = "", share: float = 1.0
) -> None:
    """Hold the committed ``keys`` (those still present) for their first read, as
    ``principal``'s, which holds at most ``share`` of the half of memory holds may take."""
    fresh = [key for key in keys if key not in ns.unread and ns.store.contains([key])[0]]
    if ttl <= 0 or not fresh:
        return
    ns.store.pin(fresh, ttl=ttl)
    deadline = ns.clock() + ttl
    for key in fresh:
        ns.unread[key] = Hold(deadline, principal)
        ns.holds_by[principal] += 1
    half = ns.slots // 2
    mine = max(1, int(half * share))
    while ns.holds_by[principal] > mine:  # its own oldest first
        key = next(k for k, hold in ns.unread.items() if hold.principal == principal)
        _release(ns, key, ns.unread.pop(key))
    while len(ns.unread) > half:
        key = next(iter(ns.unread))
        _release(ns, key, ns.unread.pop(key))


def take(ns: Namespace, keys: list[bytes]) -> dict[bytes, Hold]:
    """Release the holds on ``keys`` (being read, or removed: the holds have done their job);
    return them (key -> hold) for :func:`restore`."""
    holds = {key: ns.unread.pop(key) for key in keys if key in ns.unread}
    for key, hold in holds.items():
        _release(ns, key, hold)
    return holds


def restore(ns: Namespace, holds: dict[bytes, Hold]) -> None:
    """Put back holds taken for a request that was then refused (it must change nothing)."""
    now = ns.clock()
    for key, hold in holds.items():
        if hold.deadline > now:
            ns.store.pin([key], ttl=hold.deadline - now)
            ns.unread[key] = hold
            ns.holds_by[hold.principal] += 1


def _release(ns: Namespace, key: bytes, hold: Hold) -> None:
    ns.holds_by[hold.principal] -= 1
    if ns.holds_by[hold.principal] <= 0:
        del ns.holds_by[hold.principal]
    if hold.deadline > ns.clock():  # an expired pin is gone already: nothing to undo
        ns.store.unpin([key])  # the pin expiring first: handoff_ttl <= lease_ttl
