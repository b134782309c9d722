"""The records of a disk tier's LMDB environment besides the payloads: ``meta`` (checked
on every reopen) and ``sums`` (a checksum and a sequence number per block, from which the
index and the eviction order are rebuilt)."""

from __future__ import annotations

import struct
from typing import Any

import lmdb

from ..._errors import IncompatibleStore
from ..._keys import BlockKey

SUM = struct.Struct("<QQ")  # checksum, sequence number


def check_meta(env: Any, db: Any, want: dict[bytes, bytes], path: str) -> None:
    """Record ``want`` in a new environment; refuse one written with other values."""
    with env.begin(write=True, db=db) as txn:
        have = {k: txn.get(k) for k in want}
        if all(v is None for v in have.values()):
            for k, v in want.items():
                txn.put(k, v)
            return
    for k, v in want.items():
        if have[k] != v:
            raise IncompatibleStore(
                f"disk tier at {path} was written with {k.decode()}={have[k]!r}, "
                f"this store uses {v!r}"
            )


def read_sums(env: Any, db: Any) -> tuple[list[tuple[int, BlockKey]], list[BlockKey]]:
    """Every block's (sequence number, key), oldest first, and the keys whose checksum
    record has the wrong size (a damaged node: not indexed, to be deleted)."""
    entries: list[tuple[int, BlockKey]] = []
    bad: list[BlockKey] = []
    with env.begin(db=db) as txn:
        for k, v in txn.cursor():
            if len(v) == SUM.size:
                entries.append((SUM.unpack(v)[1], BlockKey(bytes(k))))
            else:
                bad.append(BlockKey(bytes(k)))
    entries.sort()
    return entries, bad


def list_orphans(env: Any, blocks: Any, sums: Any) -> tuple[list[BlockKey], str | None]:
    """Payloads without a checksum record, and why the listing stopped early (if it did:
    LMDB could not read a page of ``blocks``)."""
    orphans: list[BlockKey] = []
    try:
        with env.begin(buffers=True) as txn:
            for raw_key in txn.cursor(db=blocks).iternext(keys=True, values=False):
                if txn.get(raw_key, db=sums) is None:
                    orphans.append(BlockKey(bytes(raw_key)))
    except lmdb.Error as e:
        return orphans, f"cannot list the payloads: {e}"
    return orphans, None
