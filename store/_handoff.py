"""Handoff holds: freshly committed blocks kept for their first read.

Prefill pushes a request's blocks and decode pulls them moments later; until then nothing
says they are wanted, and a policy that evicts never-reused blocks first (``reuse``) would
drop them first. So a commit pins its new blocks for ``ttl`` seconds; the pin goes at the
first read, at the deadline, or oldest first once holds would fill more than half of the
namespace's memory (so pushes alone cannot fill it with pins). The server calls these under
its state lock.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._namespaces import Namespace


def hand_off(ns: Namespace, keys: Sequence[bytes], ttl: float) -> None:
    """Hold the committed ``keys`` (those still present) for their first read."""
    fresh = [key for key in keys if key not in ns.unread and ns.store.contains([key])[0]]
    if ttl <= 0 or not fresh:
        return
    ns.store.pin(fresh, ttl=ttl)
    deadline = ns.clock() + ttl
    for key in fresh:
        ns.unread[key] = deadline
    while len(ns.unread) > ns.slots // 2:
        key = next(iter(ns.unread))
        _release(ns, key, ns.unread.pop(key))


def take(ns: Namespace, keys: list[bytes]) -> dict[bytes, float]:
    """Release the holds on ``keys`` (being read, or removed: the holds have done their job);
    return them (key -> deadline) for :func:`restore`."""
    holds = {key: ns.unread.pop(key) for key in keys if key in ns.unread}
    for key, deadline in holds.items():
        _release(ns, key, deadline)
    return holds


def restore(ns: Namespace, holds: dict[bytes, float]) -> None:
    """Put back holds taken for a request that was then refused (it must change nothing)."""
    now = ns.clock()
    for key, deadline in holds.items():
        if deadline > now:
            ns.store.pin([key], ttl=deadline - now)
            ns.unread[key] = deadline


def _release(ns: Namespace, key: bytes, deadline: float) -> None:
    if deadline > ns.clock():  # an expired pin is gone already: nothing to undo
        ns.store.unpin([key])  # the pin expiring first: handoff_ttl <= lease_ttl
