"""Which keys entered or left a store, for whoever watches it (a server's event stream).

Tiers tell their eviction order of every key they gain or lose (``insert``, ``remove``:
see :class:`~kvbridge.store.local._held.HeldOrder`); those calls note the key here while the
store's lock is held. When the lock's outermost holder lets go, the noted keys are looked
up once more (a batch that failed has already taken back what it added, a block demoted
from memory to disk is still in the store) and reported with where each is now. A watcher
therefore never hears of a block that the operation did not keep, and hears each key once
per operation however many tiers it crossed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from types import TracebackType

from .._keys import BlockKey

Change = tuple[BlockKey, str | None]
"""A key and the name of the highest tier that holds it now (``None``: it left the store)."""

Report = Callable[[list[Change]], None]
"""Called under the store's lock: it must only hand the changes on (a queue), never wait."""


class Changes:
    """The keys noted since the lock was last released, while someone watches."""

    def __init__(self) -> None:
        self.touched: dict[BlockKey, None] | None = None
        """``None`` while nobody watches: noting a key then costs one test."""
        self._report: Report | None = None

    def watch(self, report: Report | None) -> None:
        """Report to ``report`` from now on (``None``: stop). Call under the store's lock."""
        self._report = report
        self.touched = None if report is None else {}

    def note(self, key: BlockKey) -> None:
        touched = self.touched
        if touched is not None:
            touched[key] = None

    def note_all(self, keys: Iterable[BlockKey]) -> None:
        touched = self.touched
        if touched is not None:
            touched.update(dict.fromkeys(keys))

    def flush(self, where: Callable[[BlockKey], str | None]) -> None:
        """Report the noted keys with ``where`` each is now (under the store's lock)."""
        touched, report = self.touched, self._report
        if not touched or report is None:
            return
        self.touched = {}
        report([(key, where(key)) for key in touched])


class ReportingLock:
    """A re-entrant lock that runs ``on_release`` (still holding it) each time its
    outermost holder lets go: what changed under it is reported in the order it happened."""

    def __init__(self, on_release: Callable[[], None]) -> None:
        self._lock = threading.RLock()
        self._depth = 0  # only the holder reads or writes it
        self._on_release = on_release

    def __enter__(self) -> None:
        self._lock.acquire()
        self._depth += 1

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self._depth == 1:
                self._on_release()
        finally:
            self._depth -= 1
            self._lock.release()
