"""kvbridge.routing: what KV-aware routers need from kvbridge.

- :class:`Relay` (``kvbridge events --publish``): a namespace's event stream republished in
  the shape Dynamo's KV indexer and llm-d's read (integer hashes, token ids, block size,
  media by name), numbered, with a replay socket; :class:`RelayStats`, what it did.
- :class:`PrefixIndex`: where each prompt's prefix is cached, per publisher, from their
  events (vLLM's own and the relay's), as a KV-aware router keeps it; :class:`IndexStats`;
  :class:`EventFollower`, the publishers (each a :class:`Source`) read into one.
- :class:`Shape` (the events' :data:`Layout` and media names), :func:`router_hash` (a key's
  integer hash: its low 64 bits), :data:`DEFAULT_MEDIA`.

The format and its rules: ``docs/EVENTS.md`` ("For routers").
"""

from __future__ import annotations

from ._follower import EventFollower, Source
from ._index import IndexStats, PrefixIndex
from ._relay import Relay, RelayStats
from ._shape import DEFAULT_MEDIA, Layout, Shape, router_hash

__all__ = [
    "DEFAULT_MEDIA",
    "EventFollower",
    "IndexStats",
    "Layout",
    "PrefixIndex",
    "Relay",
    "RelayStats",
    "Shape",
    "Source",
    "router_hash",
]
