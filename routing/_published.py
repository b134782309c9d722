"""What the routers were told a namespace holds, and the events that keep them right.

The relay hears kvbridge's stream (keys, tiers, lineage) and tells the routers in their
terms. It keeps, per key it told them of, the medium it named and the block's lineage: a
block moving between tiers becomes ``BlockRemoved`` from the old medium and ``BlockStored``
in the new one; a block the routers cannot index (saved without token ids) is never
published; a resync (a gap, a restart of the relay or of the server, a namespace cleared)
is a diff of this view against a snapshot, so a router never hears ``AllBlocksCleared``
(on a shared stream it would wipe what other publishers told it) and never keeps a block
the namespace no longer holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvbridge.store import TOKEN_BYTES, BlockKey, KeySnapshot, Lineage

from ._shape import Shape

KEYS_PER_MESSAGE = 1024
"""Keys in one republished message at most (with 16-token blocks about 100 KiB)."""


@dataclass(frozen=True)
class _Told:
    medium: str
    lineage: Lineage


@dataclass(frozen=True)
class _Op:
    stored: bool
    key: BlockKey
    medium: str
    lineage: Lineage | None = None


class Published:
    """The routers' view of one namespace, and the events not sent yet."""

    def __init__(self, shape: Shape, block_tokens: int) -> None:
        self._shape = shape
        self._block_tokens = block_tokens
        self._told: dict[BlockKey, _Told] = {}
        self._ops: list[_Op] = []
        self.untokened = 0
        """Blocks heard of without token ids (or with other than ``block_tokens``):
        never published, a router could not index them."""

    def __len__(self) -> int:
        return len(self._told)

    def stored(self, key: BlockKey, medium: str, lineage: Lineage | None) -> None:
        """kvbridge says ``key`` is in ``medium`` (its name: ``CPU``, ``STORAGE``, ...)."""
        told = self._told.get(key)
        if lineage is None and told is not None:
            lineage = told.lineage  # a tier change the server reported without it
        if lineage is None or len(lineage.tokens) != self._block_tokens * TOKEN_BYTES:
            self.untokened += 1
            return
        named = self._shape.medium(medium)
        if told is not None and told.medium == named:
            return
        if told is not None:
            self._ops.append(_Op(False, key, told.medium))
        self._told[key] = _Told(named, lineage)
        self._ops.append(_Op(True, key, named, lineage))

    def removed(self, key: BlockKey) -> None:
        told = self._told.pop(key, None)
        if told is not None:
            self._ops.append(_Op(False, key, told.medium))

    def resync(self, snapshot: KeySnapshot) -> None:
        """Make the view the snapshot's: what left is removed, what is new or moved is
        stored, parents before their children."""
        lineage = snapshot.lineage or [None] * len(snapshot.keys)
        media = snapshot.media or [None] * len(snapshot.keys)
        now = {
            key: (medium, kept)
            for key, kept, medium in zip(snapshot.keys, lineage, media, strict=True)
            if medium is not None
        }
        for key in [key for key in self._told if key not in now]:
            self.removed(key)
        for key in sorted(now, key=_depths(now).__getitem__):
            medium, kept = now[key]
            self.stored(key, medium, kept)

    def take(self) -> Iterator[list[object]]:
        """The events not sent yet, as messages of at most :data:`KEYS_PER_MESSAGE` keys:
        consecutive blocks of one chain in one medium are one ``BlockStored``."""
        ops, self._ops = self._ops, []
        for start in range(0, len(ops), KEYS_PER_MESSAGE):
            yield self._events(ops[start : start + KEYS_PER_MESSAGE])

    def _events(self, ops: list[_Op]) -> list[object]:
        events: list[object] = []
        run: list[_Op] = []
        for op in ops:
            if run and not _continues(run[-1], op):
                events.append(self._event(run))
                run = []
            run.append(op)
        if run:
            events.append(self._event(run))
        return events

    def _event(self, run: list[_Op]) -> object:
        keys = [op.key for op in run]
        first = run[0]
        if not first.stored:
            return self._shape.removed(keys, first.medium)
        assert first.lineage is not None
        ids = b"".join(op.lineage.tokens for op in run if op.lineage is not None)
        tokens: list[int] = np.frombuffer(ids, dtype="<i4").tolist()
        return self._shape.stored(
            keys, first.lineage.parent, tokens, self._block_tokens, first.medium
        )


def _continues(last: _Op, op: _Op) -> bool:
    """Whether ``op`` joins the event of ``last``: removals of one medium; stores of one
    medium, each the child of the one before."""
    if (last.stored, last.medium) != (op.stored, op.medium):
        return False
    return not op.stored or (op.lineage is not None and op.lineage.parent == last.key)


def _depths(blocks: dict[BlockKey, tuple[str, Lineage | None]]) -> dict[BlockKey, int]:
    """Each key's distance from the first block of its chain among ``blocks`` (a parent not
    among them starts a chain): stored in that order, every parent comes first."""
    depth: dict[BlockKey, int] = {}
    for key in blocks:
        path: list[BlockKey] = []
        at: BlockKey | None = key
        while at is not None and at not in depth and at in blocks and at not in path:
            path.append(at)
            kept = blocks[at][1]
            at = None if kept is None else kept.parent
        base = depth.get(at, -1) if at is not None else -1
        for n, step in enumerate(reversed(path), start=1):
            depth[step] = base + n
    return depth
