"""Where each prompt's prefix is cached, from the publishers' events: the index a KV-aware
router keeps (``kvbridge proxy --route kv`` is to read it).

Sources are publishers: each vLLM instance's own KV events (its GPU prefix cache,
``--kv-events-config``) and a relay of kvbridge's shared tiers (``Relay``). A source's
``BlockStored`` says its blocks by hash, each the child of the one before (the first of the
event's ``parent_block_hash``), with their token ids; the index keeps one node per distinct
block of token ids under its parent, and which sources hold it. ``matched(tokens)`` walks
the prompt a block at a time and answers, per source, how many leading tokens it holds: a
source counts a block only while it holds every block before it, as a prefix cache loads.

Hashes are a source's own identities (vLLM's, or the relay's integers): the index never
compares them across sources; it compares token ids. A stored block whose parent the
source never told of is dropped (it could never be matched from the root), as Dynamo's
indexer does. Sans-IO: whoever reads the sockets applies what it read (``apply``).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

MAX_NODES = 1 << 22
"""Distinct blocks kept at most (4M: some 1 GB of a router's memory with 16-token blocks);
past it new blocks are not indexed (counted in ``IndexStats.refused``)."""

Hash = int | bytes


@dataclass
class IndexStats:
    applied: int = 0
    dropped_orphans: int = 0
    """Stored blocks whose parent their source never told of."""
    refused: int = 0
    """Stored blocks past ``MAX_NODES``."""
    malformed: int = 0


@dataclass
class _Node:
    parent: int | None
    tokens: tuple[int, ...]
    holders: dict[str, str] = field(default_factory=dict)
    """source -> the medium it holds the block in."""


class PrefixIndex:
    """Blocks of token ids under their parents, and the sources that hold each."""

    def __init__(self, block_size: int, *, max_nodes: int = MAX_NODES) -> None:
        self.block_size = block_size
        self._max = max_nodes
        self._ids = itertools.count(1)
        self._nodes: dict[int, _Node] = {}
        self._by_tokens: dict[tuple[int | None, tuple[int, ...]], int] = {}
        self._children: Counter[int] = Counter()
        self._by_hash: dict[str, dict[Hash, int]] = {}
        self.stats = IndexStats()

    def __len__(self) -> int:
        return len(self._nodes)

    def apply(self, source: str, events: Iterable[Any]) -> None:
        """One batch's events of ``source``: arrays (llm-d's layout) or maps tagged
        ``type`` (vLLM's); what does not fit the shape is counted and skipped."""
        for event in events:
            fields = _fields(event)
            if fields is None:
                self.stats.malformed += 1
                continue
            kind = fields["type"]
            if kind == "BlockStored":
                self._stored(source, fields)
            elif kind == "BlockRemoved":
                for block in _hashes(fields) or []:
                    self._release(source, block)
            elif kind == "AllBlocksCleared":
                self.forget(source)
            self.stats.applied += 1

    def forget(self, source: str) -> None:
        """Everything ``source`` told of is gone (cleared, or the source left)."""
        for block in list(self._by_hash.get(source, {})):
            self._release(source, block)
        self._by_hash.pop(source, None)

    def matched(self, tokens: list[int]) -> dict[str, int]:
        """Per source, the leading tokens of ``tokens`` it holds, whole blocks only."""
        size = self.block_size
        found: dict[str, int] = {}
        live: set[str] | None = None
        parent: int | None = None
        for n in range(len(tokens) // size):
            node_id = self._by_tokens.get((parent, tuple(tokens[n * size : (n + 1) * size])))
            if node_id is None:
                break
            holders = set(self._nodes[node_id].holders)
            live = holders if live is None else live & holders
            if not live:
                break
            for source in live:
                found[source] = (n + 1) * size
            parent = node_id
        return found

    def _stored(self, source: str, fields: dict[str, Any]) -> None:
        hashes, tokens = _hashes(fields), _list(fields.get("token_ids"))
        size = fields.get("block_size")
        up = fields.get("parent_block_hash")
        if (
            hashes is None
            or size != self.block_size
            or len(tokens) != size * len(hashes)
            or not (up is None or isinstance(up, int | bytes))
        ):
            self.stats.malformed += 1
            return
        known = self._by_hash.setdefault(source, {})
        parent = None if up is None else known.get(up)
        if up is not None and parent is None:
            self.stats.dropped_orphans += len(hashes)
            return
        medium = str(fields.get("medium") or "GPU")
        for n, block in enumerate(hashes):
            node_id = self._node(parent, tuple(tokens[n * size : (n + 1) * size]))
            if node_id is None:
                self.stats.refused += len(hashes) - n
                return
            if known.get(block) not in (None, node_id):
                self._release(source, block)  # a hash reused for other tokens
            known[block] = node_id
            self._nodes[node_id].holders[source] = medium
            parent = node_id

    def _node(self, parent: int | None, tokens: tuple[int, ...]) -> int | None:
        node_id = self._by_tokens.get((parent, tokens))
        if node_id is not None:
            return node_id
        if len(self._nodes) >= self._max:
            return None
        node_id = next(self._ids)
        self._nodes[node_id] = _Node(parent, tokens)
        self._by_tokens[(parent, tokens)] = node_id
        if parent is not None:
            self._children[parent] += 1
        return node_id

    def _release(self, source: str, block: Hash) -> None:
        node_id = self._by_hash.get(source, {}).pop(block, None)
        if node_id is None:
            return
        self._nodes[node_id].holders.pop(source, None)
        self._prune(node_id)

    def _prune(self, node_id: int | None) -> None:
        """Drop nodes nobody holds and nothing hangs under, up the chain."""
        while node_id is not None:
            node = self._nodes[node_id]
            if node.holders or self._children[node_id]:
                return
            del self._nodes[node_id]
            del self._by_tokens[(node.parent, node.tokens)]
            self._children.pop(node_id, None)
            if node.parent is not None:
                self._children[node.parent] -= 1
            node_id = node.parent


_ARRAY_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _fields(event: Any) -> dict[str, Any] | None:
    """An event as a map of its fields (``type`` included), from either layout."""
    if isinstance(event, dict):
        return event if event.get("type") in _ARRAY_FIELDS else None
    if not isinstance(event, list) or not event or event[0] not in _ARRAY_FIELDS:
        return None
    names = _ARRAY_FIELDS[event[0]]
    return {"type": event[0], **dict(zip(names, event[1:], strict=False))}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _hashes(fields: dict[str, Any]) -> list[Hash] | None:
    """An event's block hashes, each an int or bytes (``None`` if any is not)."""
    hashes = _list(fields.get("block_hashes"))
    return hashes if all(isinstance(h, int | bytes) for h in hashes) else None
