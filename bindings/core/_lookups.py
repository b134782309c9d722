"""Lookups and pins off the engine's scheduler loop.

An engine's scheduler asks about every new request in the loop that schedules all of
them; a lookup and a pin are two round trips to the store, and a store that stopped
answering would hold them for the whole store timeout. :class:`Lookups` runs them on a
few threads of their own: the scheduler starts one (:meth:`Lookups.start`), reads its
answer on a later call (:meth:`Lookup.answer`), and gives up on one that is late
(:meth:`Lookup.drop`: its pin, when it comes, is released). Releases of pins are queued
on the same threads (a release is queued only once its pin was answered). Nothing here
waits on the network in the caller's thread: a call costs a lock hand-off and a queue put.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..._closing import Closing
from ...store import Lease

Hit = tuple[int, Lease | None]
"""A lookup's answer: how many leading blocks the store holds, and the pin on those past
the first ones the engine has itself (``None``: nothing to pin, or the pin failed)."""


_log = logging.getLogger("kvbridge.bindings")


class Store(Protocol):
    """What :class:`Lookups` calls (a :class:`~kvbridge.bindings.core.ConnectorCore`,
    whose calls answer a miss on a store fault rather than raise, or an adapter over one
    whose keys are sequences of its own: one item a block, sliced as a list)."""

    def lookup(self, keys: Any) -> int: ...

    def pin(self, keys: Any, start: int = 0) -> Lease | None: ...

    def unpin(self, hold: Lease | None) -> None: ...


class Lookup:
    """One lookup (and pin) in flight. Thread-safe: the lookup thread answers, the
    scheduler reads or drops."""

    def __init__(
        self, keys: Sequence[Any], first: int, started: float, known: int | None = None
    ) -> None:
        self.keys = keys
        self.first = first
        """Blocks the engine holds itself: only those after them are pinned."""
        self.known = known
        """Leading blocks the store's mirror says it holds: pinned without a lookup first
        (a lookup follows only when the pin fails)."""
        self.started = started
        """When it was started, on the scheduler's clock."""
        self._lock = threading.Lock()
        self._answer: Hit | None = None
        self._dropped = False

    def answer(self) -> Hit | None:
        """The answer, or ``None`` while it is still being asked."""
        with self._lock:
            return self._answer

    def drop(self) -> Lease | None:
        """Nobody waits for this answer any more. Returns the pin of an answer that came
        already (the caller releases it); a later answer's pin is released when it comes."""
        with self._lock:
            self._dropped = True
            answer, self._answer = self._answer, None
        return None if answer is None else answer[1]

    def dropped(self) -> bool:
        with self._lock:
            return self._dropped

    def settle(self, answer: Hit) -> bool:
        """The lookup thread's answer; False when it was dropped meanwhile (its pin is
        then the lookup thread's to release)."""
        with self._lock:
            if self._dropped:
                return False
            self._answer = answer
            return True


@dataclass(frozen=True)
class _Unpin:
    hold: Lease


_STOP = object()


class Lookups(Closing):
    """The thread that asks the store for the scheduler (see the module's docstring)."""

    def __init__(self, store: Store, clock: Callable[[], float], workers: int = 1) -> None:
        """``workers`` threads ask the store side by side (give the store as many
        connections): a burst of new requests is not looked up one round trip after
        another."""
        self._store = store
        self._clock = clock
        self._jobs: queue.SimpleQueue[Lookup | _Unpin | object] = queue.SimpleQueue()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, name=f"kvbridge-lookups-{i}", daemon=True)
            for i in range(max(1, workers))
        ]
        for thread in self._threads:
            thread.start()

    def start(self, keys: Sequence[Any], first: int, known: int | None = None) -> Lookup:
        """Ask how many leading ``keys`` the store holds and pin those from ``first`` on
        (the block index of ``keys[first]`` is ``first``: keys start a prompt); with
        ``known``, pin that many at once and look up only if that fails."""
        lookup = Lookup(keys, first, self._clock(), known)
        self._jobs.put(lookup)
        return lookup

    def unpin(self, hold: Lease | None) -> None:
        """Release a pin, after everything queued before."""
        if hold is not None:
            self._jobs.put(_Unpin(hold))

    def close(self) -> None:
        """Stop: the releases queued so far are made, the lookups are not (each answers a
        miss)."""
        if not self._closed:
            self._closed = True
            for _ in self._threads:
                self._jobs.put(_STOP)
            for thread in self._threads:
                thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            try:
                self._do(job)
            except Exception:  # a bug must not end the thread every lookup waits on
                _log.exception("kvbridge lookup failed")
                if isinstance(job, Lookup):
                    job.settle((0, None))

    def _do(self, job: object) -> None:
        if isinstance(job, _Unpin):
            self._store.unpin(job.hold)
        elif isinstance(job, Lookup) and not job.dropped():
            answer = (0, None) if self._closed else self._ask(job)
            if not job.settle(answer):
                self._store.unpin(answer[1])  # nobody waits: release at once

    def _ask(self, job: Lookup) -> Hit:
        if job.known is not None and job.known > job.first:
            hold = self._store.pin(job.keys[job.first : job.known], job.first)
            if hold is not None:
                return job.known, hold
        hit = self._store.lookup(job.keys)
        if hit <= job.first:
            return hit, None
        hold = self._store.pin(job.keys[job.first : hit], job.first)
        return (hit, hold) if hold is not None else (0, None)
