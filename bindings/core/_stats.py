"""The connector's counters: what it looked up, hit, loaded and saved, and how long that
took. Engines read them per interval (``take``, which resets) and in total (``totals``)."""

from __future__ import annotations

import threading
import time
from typing import Any

COUNTERS = (
    "lookups",
    "lookups_late",
    "lookups_local",
    "tokens_looked_up",
    "tokens_hit",
    "tokens_loaded",
    "bytes_loaded",
    "load_failures",
    "tokens_load_failed",
    "tokens_lost_gone",
    "tokens_lost_corrupt",
    "tokens_lost_lease",
    "tokens_lost_timeout",
    "tokens_lost_fault",
    "tokens_lost_paused",
    "tokens_lost_declined",
    "tokens_saved",
    "bytes_saved",
    "blocks_not_saved",
    "store_faults",
    "bytes_staged",
)
TIMINGS = ("lookup_seconds", "load_seconds", "save_seconds")
LOST_REASONS = ("gone", "corrupt", "lease", "timeout", "fault", "paused", "declined")
"""Why hits a lookup advertised were not delivered (``tokens_lost_<reason>``): the block was
evicted or removed between the lookup and the read (``gone``), landed bad (``corrupt``: its
checksum), was read past its lease (``lease``), the read timed out (``timeout``), the store
failed or refused otherwise (``fault``), store calls were paused after a fault
(``paused``), or the engine did not take the hit it was offered (``declined``: vLLM gave the
request fewer tokens to load than the lookup found)."""


class ConnectorStats:
    """Thread-safe counters (a saver thread and the engine's thread both count)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._interval = _zero()
        self._total = _zero()

    def lookup(self, asked_tokens: int, hit_tokens: int, started: float) -> None:
        self._add(
            lookups=1,
            tokens_looked_up=asked_tokens,
            tokens_hit=hit_tokens,
            lookup_seconds=time.perf_counter() - started,
        )

    def lookup_local(self) -> None:
        """A lookup the store's mirror answered (no call)."""
        self._add(lookups_local=1)

    def lookup_late(self) -> None:
        """A lookup answered later than the engine could wait: a miss for its request."""
        self._add(lookups_late=1)

    def loaded(self, tokens: int, nbytes: int, started: float) -> None:
        self._add(
            tokens_loaded=tokens, bytes_loaded=nbytes, load_seconds=time.perf_counter() - started
        )

    def load_failed(self, tokens: int, reason: str) -> None:
        """Hits not delivered, by ``reason`` (one of :data:`LOST_REASONS`)."""
        self._add(load_failures=1, tokens_load_failed=tokens, **{f"tokens_lost_{reason}": tokens})

    def declined(self, tokens: int) -> None:
        """Hit tokens offered to the engine that it did not take (no load was tried)."""
        self._add(tokens_lost_declined=tokens)

    def saved(self, tokens: int, nbytes: int, started: float) -> None:
        self._add(
            tokens_saved=tokens, bytes_saved=nbytes, save_seconds=time.perf_counter() - started
        )

    def staged(self, nbytes: int) -> None:
        """Bytes copied between the engine's memory and the staging buffer."""
        self._add(bytes_staged=nbytes)

    def save_skipped(self, blocks: int) -> None:
        self._add(blocks_not_saved=blocks)

    def fault(self) -> None:
        self._add(store_faults=1)

    def take(self) -> dict[str, Any]:
        """The counts since the last ``take`` (and reset them)."""
        with self._lock:
            interval, self._interval = self._interval, _zero()
        return interval

    def totals(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._total)

    def _add(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._interval[name] += amount
                self._total[name] += amount


def _zero() -> dict[str, Any]:
    return {**dict.fromkeys(COUNTERS, 0), **dict.fromkeys(TIMINGS, 0.0)}
