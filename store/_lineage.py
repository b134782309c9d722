"""What a block's key was hashed from: its parent's key and its token ids.

A cache server stores blocks by key and never sees tokens, so a KV-aware router (Dynamo's,
llm-d's), which indexes prompts by their token ids, cannot use its events on keys alone.
A connector therefore sends each saved block's lineage with the save (``stage``'s
``lineage`` field, :data:`~kvbridge.store._wire` ``stage``); the server keeps it beside the
block while the block is stored, and reports it in ``BlockStored`` and in snapshots
(``docs/EVENTS.md``). A namespace states its tokens per block when it is created
(``block_tokens``): every lineage it keeps then has exactly that many, and their memory
comes out of the namespace's share.

Token ids travel as int32, little-endian: every tokenizer's vocabulary fits (the largest
are a few hundred thousand ids).
"""

from __future__ import annotations

import array
import sys
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._keys import KEY_LENGTHS, BlockKey
from ._wire import BadRequest

TOKEN_BYTES = 4
MAX_BLOCK_TOKENS = 4096
"""Tokens per block at most: vLLM's largest block sizes (hybrid models align attention
blocks to their state's size) are a few thousand tokens. One block's ``BlockStored``
(5 bytes a token id in msgpack) then fits a stream message (``MESSAGE_BATCH_BYTES``)."""
BOOKED_BYTES = 256
"""What one lineage costs besides its token ids: measured with ``tracemalloc``, 20,000
entries of 16 token ids kept 172 bytes each (107 besides the ids) with their parent keys
shared; a parent decoded from the wire is a bytes object of its own (65 bytes)."""
STAGE_LINEAGE_BYTES = 768 << 10
"""Lineage bytes in one ``stage`` request at most (the control plane takes 1 MiB: the rest
is the keys and their framing); a client cuts its puts so."""


class BadLineage(BadRequest):
    """Token ids that are not a block's: the wrong count, or not int32 token ids (a
    ``BadRequest`` on the wire)."""


@dataclass(frozen=True)
class Lineage:
    """A block's parent key (``None`` for a prompt's first block) and its token ids, as
    int32 little-endian bytes (:meth:`of` makes one from ids)."""

    parent: BlockKey | None
    tokens: bytes

    @classmethod
    def of(cls, parent: bytes | None, token_ids: Sequence[int] | np.ndarray) -> Lineage:
        up = None if parent is None else BlockKey(bytes(parent))
        if isinstance(token_ids, np.ndarray):
            return cls(up, _numpy_ids(token_ids))
        try:  # a list or a range of ints: array's C loop checks each (17 us a block in numpy)
            ids = array.array("i", token_ids)
        except (TypeError, OverflowError):
            raise BadLineage("token ids are integers within int32") from None
        if ids and min(ids) < 0:
            raise BadLineage("a token id is negative")
        if sys.byteorder == "big":
            ids.byteswap()
        return cls(up, ids.tobytes())

    @property
    def token_ids(self) -> list[int]:
        ids: list[int] = np.frombuffer(self.tokens, dtype="<i4").tolist()
        return ids

    @classmethod
    def of_wire(cls, entry: Any, block_tokens: int | None = None) -> Lineage:
        """An entry as it crossed the wire, ``[parent key or nil, token ids]``, checked
        (``block_tokens`` of them when given); :class:`BadLineage` for anything else."""
        if not (isinstance(entry, list) and len(entry) == 2):
            raise BadLineage("a lineage entry is [parent, tokens]")
        parent, tokens = entry
        if parent is not None and (type(parent) is not bytes or len(parent) not in KEY_LENGTHS):
            raise BadLineage("a lineage's parent is a key or nil")
        if type(tokens) is not bytes or len(tokens) % TOKEN_BYTES:
            raise BadLineage("a lineage's token ids are int32s")
        if block_tokens is not None and len(tokens) != block_tokens * TOKEN_BYTES:
            raise BadLineage(f"a block's token ids are {block_tokens} int32s")
        if _negative(tokens):
            raise BadLineage("a token id is negative")
        return cls(None if parent is None else BlockKey(parent), tokens)

    def wire(self) -> list[bytes | None]:
        return [None if self.parent is None else bytes(self.parent), self.tokens]


def _numpy_ids(ids: np.ndarray) -> bytes:
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise BadLineage("token ids are a flat sequence of integers")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= 1 << 31):
        raise BadLineage("a token id is outside int32's non-negative range")
    return ids.astype("<i4").tobytes()


def _negative(tokens: bytes) -> bool:
    """Whether any little-endian int32 of ``tokens`` is negative: its last byte's high bit
    (one C-level scan of every fourth byte)."""
    return max(tokens[3::TOKEN_BYTES], default=0) >= 0x80


def lineage_bytes(block_tokens: int) -> int:
    """What the server books per block of a namespace with ``block_tokens`` tokens."""
    return block_tokens * TOKEN_BYTES + BOOKED_BYTES if block_tokens else 0


def check_block_tokens(block_tokens: int) -> int:
    if type(block_tokens) is not int or not 0 <= block_tokens <= MAX_BLOCK_TOKENS:
        raise BadLineage(f"block_tokens {block_tokens!r}: an integer from 0 to {MAX_BLOCK_TOKENS}")
    return block_tokens


def from_wire(entries: Any, count: int, block_tokens: int) -> list[Lineage | None]:
    """A ``stage`` request's ``lineage`` field: ``count`` entries, each ``nil`` or
    ``[parent key or nil, token ids]``; :class:`BadLineage` for anything else."""
    if not isinstance(entries, list) or len(entries) != count:
        raise BadLineage(f"lineage is a list of one entry per key ({count})")
    if not block_tokens and any(entry is not None for entry in entries):
        raise BadLineage("this namespace keeps no token ids: open it with block_tokens")
    return [None if entry is None else Lineage.of_wire(entry, block_tokens) for entry in entries]


class LineageBook:
    """One namespace's lineages, by key: at most ``blocks`` of them (the namespace's
    blocks in all tiers), the oldest forgotten first. Kept at commit, before the blocks
    become visible; a key that left the store keeps its entry until it is pushed out (a
    stored key's lineage is what its key was hashed from: it never changes). Under the
    namespace's lock; read by the store's watcher (a dict lookup)."""

    def __init__(self, blocks: int) -> None:
        self._blocks = blocks
        self._by_key: OrderedDict[BlockKey, Lineage] = OrderedDict()

    def keep(self, keys: Iterable[BlockKey], lineage: Iterable[Lineage | None]) -> None:
        book = self._by_key
        for key, entry in zip(keys, lineage, strict=True):
            if entry is None:
                continue
            book[key] = entry
            book.move_to_end(key)
        while len(book) > self._blocks:
            book.popitem(last=False)

    def get(self, key: BlockKey) -> Lineage | None:
        return self._by_key.get(key)

    def __len__(self) -> int:
        return len(self._by_key)
