"""Disk blocks for LMDB's map, allocated before LMDB may write into them.

With ``writemap`` LMDB writes pages straight into a shared mapping of its data file (2.7x to
3.6x faster puts than building pages in memory and ``pwrite``-ing them). If the file were
sparse, the first write into a hole would need a new disk block, and on a full file system
that page fault is a SIGBUS that kills the process. So the tier keeps the map no larger than
the disk blocks it has allocated (``posix_fallocate``): LMDB never writes outside its map,
every page inside it has its block, and a transaction that needs more pages than the map
holds fails with ``MDB_MAP_FULL``, which the tier turns into ``StoreFull`` for that put.

The map grows before each write transaction to LMDB's high-water mark plus what one
transaction may add, in steps of :data:`GROW_STEP`, up to the tier's largest map; on a
file system with less room than that it grows by what is left, and LMDB goes on reusing
its free pages. The data file holds the pages LMDB used plus at most a step or so.
"""

from __future__ import annotations

import os
from typing import Any

from ..._errors import StoreFull
from ._reads import ReadGate

INITIAL_MAP_BYTES = 256 << 10
"""A new tier's map before its first write transaction (LMDB's meta and root pages)."""

GROW_STEP = 64 << 20
"""The map grows by at least this much at a time (one ``fallocate`` per 64 MiB written)."""

TXN_SLACK_BYTES = 4 << 20
"""Room beyond a transaction's payload: leaf, branch and free-list pages it copies on write."""


_FS_SLACK_BYTES = 64 << 10
"""Left to the file system when the map takes what is left of it."""


class DiskSpace:
    """The map size of one LMDB environment and the disk blocks behind it."""

    def __init__(self, path: str, largest: int, txn_bytes: int, gate: ReadGate) -> None:
        self._path = path
        self._gate = gate  # set_mapsize waits for prefetch reads
        self._largest = largest
        self._txn_room = txn_bytes + txn_bytes // 8 + TXN_SLACK_BYTES
        self._fd = -1
        self.map_bytes = 0

    @classmethod
    def attach(cls, env: Any, path: str, largest: int, txn_bytes: int, gate: ReadGate) -> DiskSpace:
        """For an environment just opened: allocate every block of its file, and grow the
        map for a first transaction (``largest`` bounds the map; ``txn_bytes`` is the most
        payload one transaction writes)."""
        space = cls(path, largest, txn_bytes, gate)
        space._fd = os.open(os.path.join(path, "data.mdb"), os.O_RDWR | os.O_CLOEXEC)
        space.map_bytes = int(env.info()["map_size"])
        try:
            os.posix_fallocate(space._fd, 0, space.map_bytes)
        except OSError as e:
            space.close()
            raise StoreFull(f"the disk under {path} has no room: {e.strerror}") from None
        space.grow(env)
        return space

    def grow(self, env: Any) -> None:
        """Before a write transaction (none may be open in this process): make the map reach
        the high-water mark plus one transaction's worth, as far as the disk allows."""
        high = (int(env.info()["last_pgno"]) + 1) * int(env.stat()["psize"])
        want = min(high + self._txn_room, self._largest)
        if want <= self.map_bytes:
            return
        step = min(max(want, self.map_bytes + GROW_STEP), self._largest)
        free = os.statvfs(self._path)
        left = self.map_bytes + free.f_bavail * free.f_frsize - _FS_SLACK_BYTES
        for size in dict.fromkeys((step, want, min(want, left))):
            if size <= self.map_bytes:
                continue
            try:
                os.posix_fallocate(self._fd, self.map_bytes, size - self.map_bytes)
            except OSError:
                continue  # no room for that much: try less
            with self._gate.exclusive():
                env.set_mapsize(size)
            self.map_bytes = size
            return

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
