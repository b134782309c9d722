"""Reads of the disk tier's blocks, each verified against its checksum, under the store's
lock or, for a prefetch, outside it.

A prefetch (``copies``) runs while other threads use the store: LMDB lets a read
transaction run beside a write transaction, but not beside ``set_mapsize`` or the
environment's close, which replace the mapping it reads. The :class:`ReadGate` keeps those
two out while a prefetch reads (they run under the store's lock and wait for it; reads made
under the store's lock do not take the gate: nothing can resize the map under them).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lmdb
import numpy as np
import xxhash

from ..._buffers import BlockArray
from ..._errors import StoreClosed
from ..._keys import BlockKey
from .._tier import BlockReader
from ._meta import SUM

Version = bytes
"""A block's record in ``sums`` (checksum and write sequence number): it names one write,
so a copy read under it is the block as long as the record is the same."""


class ReadGate:
    """Many prefetch readers, or one thing that replaces the map: never both at once."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._readers = 0
        self._exclusive = False

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: not self._exclusive)
            self._readers += 1
        try:
            yield
        finally:
            with self._changed:
                self._readers -= 1
                self._changed.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: not self._exclusive and self._readers == 0)
            self._exclusive = True
        try:
            yield
        finally:
            with self._changed:
                self._exclusive = False
                self._changed.notify_all()


class DiskReads:
    """Verified reads of one environment's ``blocks`` and ``sums`` databases."""

    def __init__(
        self, handles: Callable[[], tuple[Any, Any, Any]], block_bytes: int, gate: ReadGate
    ) -> None:
        # (environment, blocks, sums) as they are now (StoreClosed once closed): a forked
        # process reopens the environment, and the databases with it
        self._handles = handles
        self._block_bytes = block_bytes
        self._gate = gate

    @contextlib.contextmanager
    def reading(self) -> Iterator[BlockReader]:
        """Yield a reader of verified, zero-copy views into the map, valid only inside this
        context; a block LMDB cannot read (a damaged page) is a miss, like a bad checksum.
        The caller holds the store's lock."""
        env, blocks, sums = self._handles()
        txns: list[Any] = []
        stale = True

        def read(key: BlockKey) -> BlockArray | None:
            nonlocal stale
            try:
                if stale:
                    txns.append(env.begin(buffers=True))
                    stale = False
                return _verified(txns[-1], blocks, sums, key, self._block_bytes)[1]
            except lmdb.Error:
                # LMDB may have failed the transaction: the next read gets a fresh one.
                # Earlier views stay valid: old ones stay open until the context ends.
                stale = True
                return None

        try:
            yield read
        finally:
            for txn in txns:
                txn.abort()

    def copies(self, keys: Sequence[BlockKey]) -> dict[BlockKey, tuple[Version, np.ndarray]]:
        """Verified copies of the blocks of ``keys`` with their versions, read without the
        store's lock (bad, absent and unreadable blocks are left out: the locked path that
        uses these meets them again and deals with them)."""
        found: dict[BlockKey, tuple[Version, np.ndarray]] = {}
        try:
            # Before the gate: in a forked process this reopens the environment, which
            # grows its map (exclusive) and must not wait for this very reader.
            env, blocks, sums = self._handles()
        except (lmdb.Error, StoreClosed):
            return found
        with self._gate.shared():
            try:
                with env.begin(buffers=True) as txn:
                    for key in keys:
                        version, view = _verified(txn, blocks, sums, key, self._block_bytes)
                        if view is not None:
                            found[key] = (version, view.copy())
            except (lmdb.Error, StoreClosed):
                pass  # a prefetch is a hint: what it could not read is read again later
        return found

    def version(self, key: BlockKey) -> Version | None:
        """The block's current ``sums`` record (caller holds the store's lock)."""
        try:
            env, _, sums = self._handles()
            with env.begin() as txn:
                meta = txn.get(key, db=sums)
        except lmdb.Error:
            return None
        return bytes(meta) if meta is not None else None


def _verified(
    txn: Any, blocks: Any, sums: Any, key: BlockKey, block_bytes: int
) -> tuple[Version, BlockArray | None]:
    """The block's version, and its payload if it matches its checksum (raises
    ``lmdb.Error`` when LMDB cannot read the pages on the way)."""
    payload = txn.get(key, db=blocks)
    meta = txn.get(key, db=sums)
    if payload is None or meta is None or len(payload) != block_bytes:
        return b"", None
    if len(meta) != SUM.size or xxhash.xxh3_64_intdigest(payload) != SUM.unpack(meta)[0]:
        return b"", None
    return bytes(meta), np.frombuffer(payload, dtype=np.uint8)
