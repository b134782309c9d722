"""Typed errors of the store.

Two families, as in h11: errors that say the caller misused the API (bad keys, wrong sizes,
a closed store) also derive from ``ValueError``/``RuntimeError`` so generic handlers work,
and every error derives from :class:`StoreError`. An operation that raises one of these has
changed nothing, unless its docstring says otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence


class StoreError(Exception):
    """Base class of every error raised by :mod:`kvbridge.store`."""


class InvalidKey(StoreError, ValueError):
    """A key is not a 16- or 32-byte ``bytes`` object."""


class InvalidBlock(StoreError, ValueError):
    """A block buffer has the wrong size, layout or type, or counts do not match."""


class InvalidTokens(StoreError, ValueError):
    """Token ids are not integers in ``[0, 2**31)``."""


class BlockNotFound(StoreError, LookupError):
    """Some keys are not in the store; ``keys`` names them in request order."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        self.keys: tuple[bytes, ...] = tuple(keys)
        shown = ", ".join(k.hex()[:16] for k in self.keys[:4])
        more = f" and {len(self.keys) - 4} more" if len(self.keys) > 4 else ""
        super().__init__(f"{len(self.keys)} block(s) not found: {shown}{more}")


class BlockCorrupt(BlockNotFound):
    """Blocks whose bytes, once landed, did not match the checksum their writer sent: a
    miss from the first of them on (``keys`` names them, ``first`` is the first one's index
    in the request). The blocks before ``first`` landed whole and verified; what the buffer
    holds from ``first`` on must not be used. A ``LookupError``, like any miss."""

    def __init__(self, keys: Sequence[bytes], first: int = 0) -> None:
        super().__init__(keys)
        self.first = first
        self.args = (
            f"block {first} of the request failed its checksum once landed: a miss from it on "
            f"({len(self.keys)} block(s))",
        )


class BlockPinned(StoreError):
    """The operation would remove or move a pinned block; ``keys`` names them."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        self.keys: tuple[bytes, ...] = tuple(keys)
        super().__init__(f"{len(self.keys)} block(s) are pinned: {self.keys[0].hex()[:16]}...")


class StoreFull(StoreError):
    """Not enough unpinned room in any tier for the new blocks; nothing was stored."""


class LeaseExpired(StoreError):
    """A staged put or a pinned read outlived its lease: its slots may have been reused, so
    the put is not committed and the read's bytes must not be trusted."""


class StoreClosed(StoreError, RuntimeError):
    """The store (or tier) has been closed."""


class IncompatibleStore(StoreError):
    """A disk tier was written with another block size, namespace or format version."""


class TierUnavailable(StoreError):
    """A configured tier needs something this machine lacks (cupy, a GPU)."""


class StoreCorrupt(StoreError):
    """The disk tier's files are damaged where LMDB keeps its own structures (not just a
    payload, which a checksum turns into a miss), so the tier cannot be read or written.
    A cache can be recomputed: delete the tier's directory and start afresh."""
