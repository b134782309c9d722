"""Fault injection for tests: what a faulty NIC, driver or DMA engine does to the bytes an
engine receives, after the transport has delivered them and before anyone has checked them.

``corrupt_received(change)`` runs ``change(views)`` on the payload views of every data
frame received in this process over the two-sided transports (``tcp``, ``memory``,
``ucx``): a read's, where they land in the reader's memory, piece by piece as they land and
before the read's digests (``Digests``) see them; a write's, where they landed in the
target's (a cache server's staged slots). Until its ``with`` block ends. Nothing in
kvbridge calls it: the cost in serving is one test of a module attribute per frame.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from . import _seams

__all__ = ["corrupt_received"]


@contextmanager
def corrupt_received(change: Callable[[Sequence[memoryview]], None]) -> Iterator[None]:
    """Let ``change`` alter what every read and write receives while the block runs."""
    if _seams.received is not None:
        raise RuntimeError("a receive fault is injected already")
    _seams.received = change
    try:
        yield
    finally:
        _seams.received = None
