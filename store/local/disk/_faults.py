"""How the disk tier meets LMDB's failures: typed errors, deletes that a damaged record
cannot take down with it, and what ``check()`` reports.

A write LMDB refuses for want of room (map full, ``ENOSPC``, or ``EIO`` from a short
write on a full file system) is :class:`StoreFull`; pages LMDB cannot make sense of are
:class:`StoreCorrupt`; anything else is a plain :class:`StoreError`. Python-LMDB carries
no errno: a plain ``lmdb.Error`` (how ``EIO``/``ENOSPC`` arrive) counts as no room.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import lmdb

from ..._errors import StoreCorrupt, StoreError, StoreFull
from ..._keys import BlockKey

_DAMAGE = (
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.BadTxnError,
    lmdb.BadRslotError,
    lmdb.BadDbiError,
    lmdb.InvalidError,
    lmdb.IncompatibleError,
    lmdb.VersionMismatchError,
    lmdb.PanicError,
)

_NO_ROOM = (lmdb.Error, lmdb.MapFullError, lmdb.DiskError, lmdb.TxnFullError)


@dataclass
class CheckReport:
    """What :meth:`DiskTier.check` found."""

    blocks: int = 0
    corrupt: list[BlockKey] = field(default_factory=list)
    """Keys whose payload is missing, of the wrong length, fails its checksum, or sits
    behind LMDB pages that cannot be read."""
    orphans: list[BlockKey] = field(default_factory=list)
    """Payloads without a checksum record."""
    damaged: list[str] = field(default_factory=list)
    """LMDB structures that could not be read or records that could not be deleted."""
    repaired: bool = False

    @property
    def ok(self) -> bool:
        return not self.corrupt and not self.orphans and not self.damaged


def lmdb_error(error: lmdb.Error, path: str) -> StoreError:
    """The typed error for an LMDB failure of the tier at ``path``."""
    if isinstance(error, _DAMAGE):
        return StoreCorrupt(
            f"disk tier at {path} is damaged ({error}); delete the directory to start "
            "afresh (a KV cache can be recomputed)"
        )
    if type(error) in _NO_ROOM:
        return StoreFull(f"disk tier at {path} could not write ({error}): the disk is full")
    return StoreError(f"disk tier at {path}: {error}")


def purge(env: Any, dbs: Sequence[Any], keys: Sequence[BlockKey]) -> list[BlockKey]:
    """Delete the records of ``keys`` from ``dbs`` in one transaction, or key by key when
    LMDB refuses (a damaged record must not keep the others). A key whose records cannot
    all go loses at least the one in ``dbs[-1]`` where LMDB allows it (the checksums: a
    reopen then does not index it). Returns the keys whose records could not all go."""
    if _delete(env, dbs, keys):
        return []
    stuck = []
    for key in keys:
        if not _delete(env, dbs, [key]):
            stuck.append(key)
            _delete(env, dbs[-1:], [key])
    return stuck


def _delete(env: Any, dbs: Sequence[Any], keys: Sequence[BlockKey]) -> bool:
    try:
        with env.begin(write=True) as txn:
            for key in keys:
                for db in dbs:
                    txn.delete(key, db=db)
    except lmdb.Error:
        return False
    return True
