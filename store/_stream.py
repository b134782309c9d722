"""The namespaces' event stream on the wire (``docs/EVENTS.md``): what a subscription is,
how a server writes a message and how a subscriber reads one.

A message is three ZMQ frames, as vLLM's KV event publisher sends them: the stream's
topic, its sequence number (8 bytes, big-endian) and a msgpack ``KVEventBatch``:
``[ts, [event, ...], None]``, each event a map tagged ``"type"``:

- ``BlockStored``: ``block_hashes`` (the keys, in the order they were committed),
  ``medium`` (``"GPU"``, ``"CPU"``, ``"STORAGE"``: the tier the blocks are in now),
  ``parent_block_hash``, ``token_ids`` and ``block_size``: for blocks saved with their
  lineage (``_lineage``) a chain's parent key, its token ids and the tokens per block;
  ``None``, ``[]``, ``0`` for blocks saved without; ``lora_id`` and ``lora_name`` ``None``
  (a LoRA adapter is part of the namespace's keys, ``extra`` of the connector's hashes);
- ``BlockRemoved``: ``block_hashes`` (the keys that left the namespace), ``medium`` ``None``;
- ``AllBlocksCleared``: the namespace left the server (the stream ends).

Reading is strict: a subscriber decodes at most :data:`MAX_MESSAGE_BYTES` and refuses
anything else than the shape above (:class:`MalformedEvent`): it then resynchronises.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

from ._keys import KEY_LENGTHS, BlockKey
from ._lineage import TOKEN_BYTES, Lineage

TICKET_PREFIX = b"kvbridge-ticket:"
"""What a subscriber sends first: this prefix and the ticket's bytes."""
RENEW = b"kvbridge-renew"
"""What a subscriber sends every :data:`RENEW_S` to keep its subscription."""
RENEW_S = 1.0
LAPSED = b"kvbridge-lapsed"
"""The server's answer to a renewal of a subscription it no longer holds (not renewed in
time: a subscriber frozen or paused past the TTL): one frame, meaning "subscribe again"."""
SUBSCRIBER_ID_BYTES = 16
"""A subscriber's routing id: 16 random bytes it chooses (none other is served)."""
MAX_KEYS_PER_MESSAGE = 4096
MAX_MESSAGE_BYTES = 256 << 10
"""A message's batch at most: 4,096 keys of 32 bytes with msgpack's framing take 140 KiB."""
MEDIUM = {"device": "GPU", "host": "CPU", "disk": "STORAGE"}
"""vLLM's names of the tiers (``vllm.distributed.kv_events``)."""


Noted = tuple[BlockKey, str | None, Lineage | None]
"""A change as the stream reports it: a key, the tier that holds it now (``None``: it left),
and, stored, what it was hashed from (``None``: not known)."""


class MalformedEvent(ValueError):
    """A message that is not an event batch of this stream's shape."""


@dataclass(frozen=True)
class Subscription:
    """Where a namespace's stream is published, its topic, and a ticket good once."""

    endpoint: str
    topic: bytes
    ticket: bytes

    @property
    def request(self) -> bytes:
        """What the subscriber sends first: the ticket, which the server turns into the
        subscription."""
        return TICKET_PREFIX + self.ticket


@dataclass(frozen=True)
class KeySnapshot:
    """A namespace's keys, holding every change numbered up to ``seq``; asked for, what
    each was hashed from (``None`` where the server keeps nothing)."""

    seq: int
    keys: list[BlockKey]
    lineage: list[Lineage | None] | None = None
    media: list[str | None] | None = None
    """With the lineage: each key's medium as the page was read (``None``: it left)."""


@dataclass(frozen=True)
class Message:
    """One message read: keys stored and removed in order, or ``cleared``."""

    seq: int
    changes: list[tuple[BlockKey, bool]]
    """Each key with True (stored) or False (removed), in the order they happened."""
    cleared: bool = False
    ts: float = 0.0
    events: tuple[dict[str, object], ...] = ()


def encode(changes: list[Noted]) -> list[dict[str, object]]:
    """Consecutive changes of one kind (stored in one tier, or removed) as one event; a
    stored event with lineage holds one chain (each block's parent is the key before it)."""
    events: list[dict[str, object]] = []
    hashes: list[bytes] = []
    tokens: list[int] = []
    last: object = object()
    for key, tier, lineage in changes:
        kind = (tier, lineage is not None)
        if kind != last or (lineage is not None and lineage.parent != BlockKey(hashes[-1])):
            hashes, tokens = [], []
            events.append(_event(tier, hashes, tokens, lineage))
            last = kind
        hashes.append(bytes(key))
        if lineage is not None:
            tokens += lineage.token_ids
    return events


def pack(events: list[dict[str, object]], ts: float) -> bytes:
    packed: bytes = msgpack.packb([ts, events, None], use_bin_type=True)
    return packed


def decode(frames: list[bytes], topic: bytes) -> Message:
    """Read one message of the stream ``topic``; :class:`MalformedEvent` if it is not one."""
    if len(frames) != 3 or frames[0] != topic or len(frames[1]) != 8:
        raise MalformedEvent("not a [topic, seq, batch] message of this stream")
    if len(frames[2]) > MAX_MESSAGE_BYTES:
        raise MalformedEvent(f"a batch of {len(frames[2])} bytes")
    try:
        batch = msgpack.unpackb(frames[2], raw=False, strict_map_key=True, max_bin_len=64)
    except Exception as exc:
        raise MalformedEvent(f"not msgpack: {exc}") from None
    if not (isinstance(batch, list) and len(batch) in (2, 3) and isinstance(batch[1], list)):
        raise MalformedEvent("a batch is [ts, events, rank]")
    ts = batch[0] if isinstance(batch[0], int | float) else 0.0
    changes: list[tuple[BlockKey, bool]] = []
    cleared = False
    for event in batch[1]:
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "AllBlocksCleared":
            cleared = True
        elif kind in ("BlockStored", "BlockRemoved"):
            changes += [(key, kind == "BlockStored") for key in _hashes(event)]
        else:
            raise MalformedEvent(f"an event of type {kind!r}")
    return Message(int.from_bytes(frames[1], "big"), changes, cleared, float(ts), tuple(batch[1]))


def _hashes(event: dict[str, object]) -> list[BlockKey]:
    hashes = event.get("block_hashes")
    if not isinstance(hashes, list) or len(hashes) > MAX_KEYS_PER_MESSAGE:
        raise MalformedEvent("block_hashes is not a list of keys")
    for key in hashes:
        if type(key) is not bytes or len(key) not in KEY_LENGTHS:
            raise MalformedEvent("a block hash is not a key")
    return [BlockKey(key) for key in hashes]


def _event(
    tier: str | None, hashes: list[bytes], tokens: list[int], lineage: Lineage | None
) -> dict[str, object]:
    """An event whose ``hashes`` (and ``tokens``) the caller fills in after."""
    if tier is None:
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": None}
    parent = None if lineage is None or lineage.parent is None else bytes(lineage.parent)
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 0 if lineage is None else len(lineage.tokens) // TOKEN_BYTES,
        "lora_id": None,
        "medium": MEDIUM.get(tier, tier.upper()),
        "lora_name": None,
    }
