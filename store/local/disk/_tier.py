"""The disk tier: blocks in an LMDB environment, each with a checksum.

Layout: three named databases in one environment.

``meta``
    ``format``, ``block_bytes`` and ``namespace``; a reopen with other values is refused.
``blocks``
    key -> payload (exactly ``block_bytes`` bytes).
``sums``
    key -> ``xxh3_64(payload)`` and an insertion sequence number (the eviction order is
    rebuilt from it on reopen).

A block and its checksum are written in one LMDB transaction, so a reader sees both or
neither; on read, a payload whose length or checksum does not match is a miss and is
dropped, never returned. ``check()`` verifies every block.

Faults (see ``_disk_faults``): a block found bad leaves the index for good; a write LMDB
refuses is StoreFull (no room) or StoreCorrupt (damaged pages) and aborts the transaction.

Durability (``sync``): commits are atomic either way, and a committed transaction lives in
the OS page cache, so a *process* crash (SIGKILL, OOM kill) loses nothing committed.
``sync=False`` (the default) skips ``fsync`` at commit: 4-5x faster writes (2.3-2.8 against
0.4-0.6 GB/s for 1 MiB values here), at the price that an OS crash or power loss may lose
the last commits or tear pages, which the checksums turn into misses; ``sync=True`` makes
every commit survive power loss. A KV cache can be recomputed: speed wins by default.

Fork: an LMDB environment must not be used across ``fork()``; the tier closes the inherited
handle and reopens the environment the first time it is used in a new process.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Container, Iterator, Sequence
from typing import Any

import lmdb
import numpy as np
import xxhash

from ..._buffers import BlockArray, to_host
from ..._checksums import NO_SUM
from ..._errors import BlockCorrupt, StoreClosed, StoreError
from ..._keys import BlockKey
from .._policy import EvictionPolicy
from .._slab import PAGE_BYTES
from .._tier import BlockReader
from ._faults import CheckReport, lmdb_error, purge
from ._meta import SUM, check_meta, list_orphans, read_sums
from ._reads import DiskReads, ReadGate, Version
from ._space import INITIAL_MAP_BYTES, DiskSpace

__all__ = ["FORMAT_VERSION", "CheckReport", "DiskTier"]

FORMAT_VERSION = b"1"
"""On-disk layout version, stored in ``meta``; bump it when the layout changes."""

TXN_FLUSH_BYTES = 64 << 20
"""A batch commits every 64 MiB written (less in a small tier, see :func:`_flush_bytes`):
LMDB keeps a write transaction's dirty pages in memory and caps their number
(MDB_IDL_UM_MAX, 128k pages), so unbounded batches would fail."""

BLOCK_RECORD_BYTES = 384
"""LMDB space a block takes beside its payload pages: its leaf entries in ``blocks`` and
``sums`` (key, page number, checksum record, node headers) and its part of the branch
pages. Measured: 323 bytes a block for 1,000 blocks of 64 KiB (17 pages each)."""

MAP_SLACK_BYTES = 1 << 20
"""Map space beside the blocks: LMDB's meta and root pages and its free list."""

# Writemap (see _disk_space for why it cannot SIGBUS): 2.7x-3.6x faster puts; bench_disk_tier,
# one run each, os.pwrite in the same run: with it 4.07 GB/s (ratio 0.39) for 64 KiB blocks
# and 4.83 (0.86) for 1 MiB, without 1.50 (0.19) and 1.35 (0.24). Every process must use it.


def _flush_bytes(capacity: int, block_bytes: int) -> int:
    """Payload bytes after which a batch commits: 64 MiB, or an eighth of a smaller tier
    (at least one block). A transaction's worth of pages is room the map keeps free."""
    return max(block_bytes, min(TXN_FLUSH_BYTES, capacity * block_bytes // 8))


def _map_size(capacity: int, block_bytes: int) -> int:
    """The largest map ``capacity`` blocks need: their pages and records, and one
    transaction's worth more (the pages a transaction frees are reused only after it
    commits, so evicting to make room needs room for the new pages first)."""
    pages = math.ceil((block_bytes + 64) / PAGE_BYTES)  # overflow pages carry a header
    per_block = pages * PAGE_BYTES + BLOCK_RECORD_BYTES
    txn = (_flush_bytes(capacity, block_bytes) // block_bytes + 1) * per_block
    return capacity * per_block + txn + txn // 8 + MAP_SLACK_BYTES


def blocks_within(max_bytes: int, block_bytes: int) -> int:
    """The most blocks a disk tier may hold whose files stay within ``max_bytes`` (0 when
    not even one fits)."""
    low, high = 0, max_bytes // block_bytes
    while low < high:  # the largest c with _map_size(c) <= max_bytes
        mid = (low + high + 1) // 2
        if _map_size(mid, block_bytes) <= max_bytes:
            low = mid
        else:
            high = mid - 1
    return low


class DiskTier:
    """Blocks of ``block_bytes`` bytes in LMDB at ``path``, at most ``capacity`` of them."""

    persistent = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        block_bytes: int,
        capacity: int,
        *,
        policy: EvictionPolicy,
        namespace: bytes = b"",
        sync: bool = False,
        name: str = "disk",
    ) -> None:
        self.name = name
        self.path = os.fspath(path)
        self.block_bytes = block_bytes
        self.capacity = capacity
        self._flush = _flush_bytes(capacity, block_bytes)
        self.policy = policy
        self.sync = sync
        self._namespace = namespace
        self._present: set[BlockKey] = set()
        self.index: Container[BlockKey] = self._present
        self._next_seq = 0
        self._txn: Any = None  # the open write transaction of a batch
        self._failed: StoreError | None = None  # why LMDB refused part of the open one
        self._pending_bytes = 0
        self._added: list[BlockKey] = []  # stored by the open transaction
        self._deleted: list[BlockKey] = []  # deleted by the open transaction
        self._purge: set[BlockKey] = set()  # forgotten; records to delete on their own
        self._env: Any = None
        self._gate = ReadGate()
        self._reads = DiskReads(
            lambda: (self._environment(), self._blocks, self._sums), block_bytes, self._gate
        )
        os.makedirs(self.path, exist_ok=True)
        try:
            self._open()
            self._load()
        except lmdb.Error as e:
            self._close_env()
            raise lmdb_error(e, self.path) from e
        except BaseException:
            self._close_env()
            raise

    # -- environment -------------------------------------------------------------------

    def _open(self) -> None:
        self._env = lmdb.open(
            self.path,
            map_size=INITIAL_MAP_BYTES,
            max_dbs=3,
            sync=self.sync,
            metasync=self.sync,
            readahead=False,
            writemap=True,  # see the note on writemap above
        )
        self._meta = self._env.open_db(b"meta")
        self._blocks = self._env.open_db(b"blocks")
        self._sums = self._env.open_db(b"sums")
        self._pid = os.getpid()
        largest = _map_size(self.capacity, self.block_bytes)
        self._space = DiskSpace.attach(
            self._env, self.path, largest, self._flush + self.block_bytes, self._gate
        )

    def _environment(self) -> Any:
        if self._env is None:
            raise StoreClosed(f"disk tier at {self.path} is closed")
        if self._pid != os.getpid():
            # Forked: the inherited handle must not be used. Closing it only unmaps and
            # closes this process's copies (LMDB clears reader slots of the closing pid only,
            # and fcntl locks are per process), and lets py-lmdb open the path again.
            self._txn = None
            self._env.close()
            self._space.close()
            self._open()
        return self._env

    def _close_env(self) -> None:
        with self._gate.exclusive():  # no prefetch reads the map it unmaps
            env, self._env = self._env, None
            if env is not None:
                env.close()
        space = getattr(self, "_space", None)
        if space is not None:
            space.close()

    def _load(self) -> None:
        """Check the meta record; rebuild the index and eviction order from the sums."""
        want = {b"format": FORMAT_VERSION, b"block_bytes": str(self.block_bytes).encode()}
        check_meta(self._env, self._meta, {**want, b"namespace": self._namespace}, self.path)
        entries, bad = read_sums(self._env, self._sums)
        self._purge.update(bad)
        if entries:
            self._next_seq = entries[-1][0] + 1
        excess = len(entries) - self.capacity
        if excess > 0:  # reopened with a smaller capacity: drop the oldest blocks
            purge(self._env, (self._blocks, self._sums), [key for _, key in entries[:excess]])
            entries = entries[excess:]
        for _, key in entries:
            self._present.add(key)
            self.policy.insert(key)
        self._purge_now()

    # -- index -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._present)

    def __contains__(self, key: object) -> bool:
        return key in self._present

    def keys(self) -> Iterator[BlockKey]:
        return iter(list(self._present))

    def touch(self, key: BlockKey) -> None:
        self.policy.touch(key)

    def _forget(self, key: BlockKey) -> None:
        if key in self._present:
            self._present.remove(key)
            self.policy.remove(key)

    # -- writes ------------------------------------------------------------------------

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Run the stores and deletes inside as few commits as possible (one per 64 MiB).

        If the body raises, what it did is committed all the same: the store's memory tiers
        already changed to match (blocks demoted here left them). If LMDB refuses the
        transaction (disk full, damaged pages) it is aborted: its stores are forgotten, its
        deletes stand, and the batch raises StoreFull or StoreCorrupt (unless the body did).
        """
        if self._txn is not None:  # nested: the outer batch commits
            yield
            return
        self._begin()
        try:
            yield
        except BaseException:
            self._end()
            raise
        error = self._end()
        if error is not None:
            raise error

    def _begin(self) -> None:
        try:
            env = self._environment()
            self._space.grow(env)
            self._txn = env.begin(write=True)
        except lmdb.Error as e:
            raise lmdb_error(e, self.path) from e

    def _end(self) -> StoreError | None:
        """Commit the open transaction (abort it if LMDB refused part of it); return the
        error that lost it, if any."""
        txn, self._txn = self._txn, None
        error, self._failed = self._failed, None
        if txn is None:  # a flush could not begin the next one
            return error
        if error is None:
            try:
                txn.commit()
            except lmdb.Error as e:  # LMDB aborted it
                error = lmdb_error(e, self.path)
                error.__cause__ = e
        else:
            txn.abort()
        if error is not None:
            for key in self._added:
                self._forget(key)
            self._purge.update(self._deleted)
        self._added.clear()
        self._deleted.clear()
        self._pending_bytes = 0
        self._purge_now()
        return error

    def _refuse(self, e: lmdb.Error) -> StoreError:  # the open transaction is lost
        self._failed = lmdb_error(e, self.path)
        return lmdb_error(e, self.path)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[Any]:
        if self._txn is None:
            with self.batch():
                yield self._txn
            return
        yield self._txn
        if self._pending_bytes >= self._flush and self._failed is None:
            error = self._end()
            self._begin()
            if error is not None:
                raise error

    def store(self, key: BlockKey, src: BlockArray, checksum: int = NO_SUM) -> None:
        """Write a new block. ``checksum``: its writer's (``_checksums``), which the bytes
        must match: :class:`BlockCorrupt` (nothing written) when they do not, as when a
        memory copy went bad before it came down here. The record keeps the bytes' own
        XXH3-64, which is the same number."""
        host = to_host(src)
        computed = xxhash.xxh3_64_intdigest(host.data)
        if checksum not in (NO_SUM, computed):
            raise BlockCorrupt([key])
        with self._writing() as txn:
            if self._failed is not None:
                raise type(self._failed)(str(self._failed))
            try:
                txn.put(key, host, db=self._blocks)
                checksum = computed
                txn.put(key, SUM.pack(checksum, self._next_seq), db=self._sums)
            except lmdb.Error as e:
                raise self._refuse(e) from e
            self._next_seq += 1
            self._pending_bytes += self.block_bytes
            self._present.add(key)
            self._added.append(key)
            self.policy.insert(key)

    def checksum(self, key: BlockKey) -> int:
        """The block's checksum on record (``NO_SUM`` when it has none)."""
        version = self._reads.version(key)
        if version is None or len(version) != SUM.size:
            return NO_SUM
        return int(SUM.unpack(version)[0])

    def position(self, key: BlockKey) -> None:
        """Blocks on disk are not adjacent in any buffer a copy could merge."""
        return None

    def reserve(self, key: BlockKey) -> None:
        """Blocks go to LMDB whole: there is no slot to fill later (see ``store``)."""
        return None

    def delete(self, key: BlockKey) -> None:
        """Forget ``key``. Does not raise on LMDB errors: a delete LMDB refuses (damaged
        pages) fails the open batch, which raises when it ends; the key stays forgotten."""
        self._forget(key)
        with self._writing() as txn:
            if self._failed is not None:
                self._purge.add(key)
                return
            try:
                txn.delete(key, db=self._blocks)
                txn.delete(key, db=self._sums)
            except lmdb.Error as e:
                self._refuse(e)
                self._purge.add(key)
                return
            self._deleted.append(key)

    def discard(self, key: BlockKey) -> None:
        """Forget a block found bad, for good: its records are deleted in a transaction of
        their own (after the open batch, if any), whatever becomes of the batch."""
        self._forget(key)
        self._purge.add(key)
        if self._txn is None:
            self._purge_now()

    def _purge_now(self) -> list[BlockKey]:
        doomed = [key for key in self._purge if key not in self._present]
        self._purge.clear()
        if not doomed or self._env is None:
            return []
        env = self._environment()
        self._space.grow(env)
        return purge(env, (self._blocks, self._sums), doomed)

    # -- reads -------------------------------------------------------------------------

    def reading(self) -> contextlib.AbstractContextManager[BlockReader]:
        """Verified, zero-copy views into the map (see ``DiskReads.reading``)."""
        return self._reads.reading()

    def copies(self, keys: Sequence[BlockKey]) -> dict[BlockKey, tuple[Version, np.ndarray]]:
        """Verified copies read without the store's lock (see ``DiskReads.copies``)."""
        return self._reads.copies(keys)

    def version(self, key: BlockKey) -> Version | None:
        return self._reads.version(key)

    def check(self, *, repair: bool = False) -> CheckReport:
        """Verify every block against its checksum; with ``repair``, drop the bad ones and
        the payloads without a checksum. Damaged LMDB pages are reported (in ``corrupt``
        for the blocks behind them, in ``damaged`` otherwise), never raised."""
        with self.reading() as read:
            corrupt = [key for key in sorted(self._present) if read(key) is None]
        report = CheckReport(blocks=len(self._present), corrupt=corrupt)
        report.orphans, damage = list_orphans(self._environment(), self._blocks, self._sums)
        report.damaged += [damage] if damage else []
        if repair and not report.ok:
            for key in corrupt:
                self._forget(key)
            self._purge.update(corrupt + report.orphans)
            stuck = self._purge_now() if self._txn is None else []
            report.damaged += [f"cannot delete the records of {key.hex()}" for key in stuck]
            report.repaired = True
        return report

    def close(self) -> None:
        if self._env is None:
            return
        if self._txn is not None:
            self._end()
        if self._pid == os.getpid():
            with contextlib.suppress(lmdb.Error):
                self._env.sync(True)
        self._close_env()
