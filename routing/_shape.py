"""The stream's shape as KV-aware routers read it: Dynamo's KV indexer and llm-d's.

Both subscribe to a ZMQ PUB socket, as vLLM's own publisher (``ZmqEventPublisher``) binds
one, and read three frames: a topic, the message's sequence number (8 bytes, big-endian,
from 0) and a msgpack ``KVEventBatch``: ``[ts, [event, ...], data_parallel_rank]``. Both
index prompts by their token ids (they hash them themselves); a block hash is an identity
only, which they want as an integer. An event is either:

- ``array`` (llm-d's adapter, and Dynamo): ``["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]``,
  ``["BlockRemoved", block_hashes, medium]``; or
- ``map`` (vLLM's own ``KVEventBatch`` decoder since vLLM PR #42892, and Dynamo): the same
  fields in a map tagged ``"type"``.

A kvbridge key is 16 or 32 bytes; its router hash is its low 64 bits: the key's last 8
bytes read big-endian, an unsigned integer (:func:`router_hash`). Two keys of one
namespace share those bits with odds of about 2^-64 per pair.

Media name where a block is, for a router that weighs tiers (llm-d: ``gpu 1.0, cpu 0.8``;
Dynamo: ``GPU``, ``CPU``, ``CPU_PINNED``, ``DISK``, ``EXTERNAL``, ...: a name it does not
know it drops, or counts as GPU). kvbridge's stream says ``GPU``, ``CPU`` or ``STORAGE``;
:data:`DEFAULT_MEDIA` says how each is republished.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgpack

Layout = Literal["array", "map"]
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's last message's sequence frame (vLLM's ``ZmqEventPublisher``)."""
DEFAULT_MEDIA: Mapping[str, str] = {"GPU": "GPU", "CPU": "CPU", "STORAGE": "DISK"}
"""kvbridge's medium names (a server's tiers) to the routers': Dynamo knows ``DISK``, not
vLLM's ``STORAGE``."""


def router_hash(key: bytes) -> int:
    """A key's integer hash for routers: its last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(key[-8:], "big")


@dataclass(frozen=True)
class Shape:
    """How events are written for the routers: their layout and media names."""

    layout: Layout = "array"
    media: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_MEDIA))

    def medium(self, kvbridge_medium: str) -> str:
        return self.media.get(kvbridge_medium, kvbridge_medium)

    def stored(
        self,
        keys: Sequence[bytes],
        parent: bytes | None,
        token_ids: list[int],
        block_size: int,
        medium: str,
    ) -> object:
        """``BlockStored`` of one chain: ``keys[0]``'s parent is ``parent``, each next key's
        the key before it; ``token_ids`` are every block's, in order."""
        hashes = [router_hash(key) for key in keys]
        up = None if parent is None else router_hash(parent)
        if self.layout == "array":
            return ["BlockStored", hashes, up, token_ids, block_size, None, medium, None]
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": up,
            "token_ids": token_ids,
            "block_size": block_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
        }

    def cleared(self) -> object:
        """``AllBlocksCleared``: every block this publisher told of is gone."""
        return ["AllBlocksCleared"] if self.layout == "array" else {"type": "AllBlocksCleared"}

    def removed(self, keys: Sequence[bytes], medium: str) -> object:
        hashes = [router_hash(key) for key in keys]
        if self.layout == "array":
            return ["BlockRemoved", hashes, medium]
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def pack(events: list[object], ts: float) -> bytes:
    """A ``KVEventBatch`` of ``events`` (no data-parallel rank: one stream per relay)."""
    packed: bytes = msgpack.packb([ts, events, None], use_bin_type=True)
    return packed
