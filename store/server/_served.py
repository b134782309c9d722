"""Stored versus served: what a namespace was asked, said it held, and handed over, and the
alarm for a cache that stores but never serves.

Per namespace, in blocks: ``lookups`` (``contains`` and ``match`` requests), ``advertised``
(blocks those lookups said are held), ``delivered`` (blocks pinned for a reader), and
``lost`` by reason: ``gone`` (asked to pin, absent: evicted or removed since the lookup),
``corrupt`` (a reader found it bad once landed, and so was the stored copy: dropped),
``transfer`` (a reader found it bad, the stored copy is sound: it went bad on its way), and
``lease`` (reads, not blocks: a read released after its lease ended, whose bytes may not be
the block's). A
connector that looks up in its mirror of the event stream asks the server only to pin: its
own counters (``tokens_hit``, ``tokens_loaded``, ``tokens_lost_<reason>``) are the other
side of this account.

The write-only alarm: a namespace whose stored bytes grew while it delivered no block for
``window`` seconds (``kvbridge serve --write-only-alarm``) is logged once, with the account,
and its gauge (``kvbridge_write_only``) is 1 until it delivers a block again. Checked as
blocks are committed (the only time stored bytes grow), on the namespace's clock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

LOST_REASONS = ("gone", "corrupt", "transfer", "lease")

_log = logging.getLogger("kvbridge.server")


class Served:
    """One namespace's account (callers hold its lock; a scrape reads it without)."""

    def __init__(self, label: str, window: float, clock: Callable[[], float]) -> None:
        """``window``: seconds of growth without a delivered block that raise the alarm
        (0: never)."""
        self.label = label
        self.lookups = 0
        self.advertised = 0
        self.delivered = 0
        self.lost = dict.fromkeys(LOST_REASONS, 0)
        self.write_only = False
        """The alarm, raised until a block is delivered again."""
        self._window = window
        self._clock = clock
        self._since = clock()
        """When a block was last delivered (or the account began)."""
        self._grown = 0
        """Bytes stored since then."""

    def looked_up(self, present: int) -> None:
        self.lookups += 1
        self.advertised += present

    def served(self, blocks: int) -> None:
        """Blocks pinned for a reader: the alarm, if raised, ends."""
        self.delivered += blocks
        self._since, self._grown = self._clock(), 0
        if self.write_only:
            self.write_only = False
            _log.info("namespace %s delivers again: the write-only alarm ends", self.label)

    def missed(self, reason: str, blocks: int) -> None:
        self.lost[reason] += blocks

    def stored(self, nbytes: int) -> None:
        """Bytes committed; raises the alarm once the window passes without a delivery."""
        self._grown += nbytes
        if self.write_only or not self._window or not self._grown:
            return
        quiet = self._clock() - self._since
        if quiet >= self._window:
            self.write_only = True
            _log.warning(
                "namespace %s stored %d MiB in %.0f s and delivered no block: write-only "
                "(%s). Do its writers and readers open the same namespace (model, layout, "
                "block size, tenant)? Do the readers' loads fail (their connectors' "
                "tokens_lost_* counters)?",
                self.label,
                self._grown >> 20,
                quiet,
                self.summary(),
            )

    def summary(self) -> str:
        lost = ", ".join(f"{reason} {count}" for reason, count in self.lost.items() if count)
        return (
            f"lookups {self.lookups}, blocks advertised {self.advertised}, delivered "
            f"{self.delivered}, lost {lost or 'none'}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "lookups": self.lookups,
            "advertised": self.advertised,
            "delivered": self.delivered,
            "lost": dict(self.lost),
            "write_only": self.write_only,
        }
