"""A namespace's keys over a cluster: one :class:`~kvbridge.store.KeyMirror` per member,
following the membership (``docs/EVENTS.md``).

A key counts as held when any member's mirror lists it (a cluster lookup finds a block
on whichever member has it; a pin that then fails costs a lookup, never a wrong byte).
The mirror answers only while every member's mirror is in step: a member whose stream is
silent or not in step yet makes :meth:`ClusterMirror.leading` answer ``None``, and the
caller asks the cluster.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Container, Sequence

from ..._closing import Closing
from .._keys import BlockKey
from ..client import KeyMirror
from ..client._mirror import Source

_log = logging.getLogger("kvbridge.mirror")

REFRESH_S = 1.0
"""How often the member list is read again (a joined member gets its mirror then)."""


class ClusterMirror(Closing):
    """Mirrors of every member (see the module's docstring)."""

    def __init__(
        self,
        members: Callable[[], list[str]],
        connect: Callable[[str], Source],
        *,
        refresh: float = REFRESH_S,
    ) -> None:
        """``members()``: the cluster's member addresses now (empty while unknown);
        ``connect(address)``: a client of that member's namespace, for its mirror."""
        self._members = members
        self._connect = connect
        self._refresh = refresh
        self._mirrors: dict[str, KeyMirror] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="kvbridge-cluster-mirror", daemon=True
        )
        self._thread.start()

    def leading(self, keys: Sequence[BlockKey]) -> int | None:
        """How many leading ``keys`` some member holds, or ``None`` while a member's
        mirror is out of step (or no member is known)."""
        views: list[Container[BlockKey]] = []
        for mirror in list(self._mirrors.values()):
            view = mirror.view()
            if view is None:
                return None
            views.append(view)
        if not views:
            return None
        for i, key in enumerate(keys):
            if not any(key in view for view in views):
                return i
        return len(keys)

    def wait_ready(self, timeout: float) -> bool:
        """Whether, within ``timeout`` seconds, a member is known and every member's
        mirror is in step (as :meth:`leading` then answers)."""
        deadline = time.monotonic() + timeout
        while True:
            mirrors = list(self._mirrors.values())
            if mirrors and all(m.wait_ready(deadline - time.monotonic()) for m in mirrors):
                if list(self._mirrors.values()) == mirrors:  # no member joined meanwhile
                    return True
            elif time.monotonic() >= deadline or self._stop.wait(
                min(self._refresh, max(0.0, deadline - time.monotonic()))
            ):
                return False

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for mirror in self._mirrors.values():
            mirror.close()
        self._mirrors = {}

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._follow(set(self._members()))
            except Exception:
                _log.exception("cluster mirror failed to follow the members")
            self._stop.wait(self._refresh)

    def _follow(self, members: set[str]) -> None:
        mirrors = dict(self._mirrors)
        for address in set(mirrors) - members:
            mirrors.pop(address).close()
        for address in members - set(mirrors):
            mirrors[address] = KeyMirror(functools.partial(self._connect, address))
        self._mirrors = mirrors  # readers see the old dict or the new, never a half
