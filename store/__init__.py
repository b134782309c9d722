"""kvbridge.store: the three stores, the contract they keep, keys, errors and settings.

Public surface (what a user needs; the building blocks live in the subpackages):

- :class:`BlockStore`, the store contract (``put``, ``get``, ``contains``,
  ``match_prefix``, ``pin``, ``remove``, ``clear``, ``close``), and :class:`Lease`, what
  every store's ``pin`` returns. Three stores keep it:

  - :class:`TieredStore`: device/host/disk tiers in this process, with dedup, eviction,
    pins and checksums (its tiers, policies and slabs: ``kvbridge.store.local``);
  - :class:`StoreClient`: a cache server, :class:`CacheServer` (``kvbridge serve``), with
    its settings (:class:`ServerConfig`, :func:`load_config`; tenants and the server's
    building blocks: ``kvbridge.store.server``);
  - :class:`ClusterClient`: the servers of a cluster found in etcd (``kvbridge serve
    --cluster``), with its registered buffers (:class:`ClusterRegion`).
- :func:`prefix_hashes` and :data:`BlockKey`: chained, deterministic block keys;
  :class:`Lineage`, what a key was hashed from (its parent and token ids), which a put may
  send for a server's events (:class:`BadLineage` when it is not a block's).
- The namespaces' event streams (``kvbridge serve --events-port``, ``docs/EVENTS.md``):
  :class:`KeyMirror`, a namespace's keys kept from its stream, and
  :class:`EventSubscriber`, one subscription read message by message; :func:`decode_events`, a
  message read (:class:`MalformedEvent` if it is none), :func:`encode_events` (of
  :data:`Noted` changes) and :func:`pack_events`, one written; :class:`Subscription` and
  :class:`KeySnapshot`, what :class:`StoreClient` hands a subscriber;
  :data:`EVENT_TICKET_PREFIX`.
- Typed errors, all subclasses of :class:`StoreError`; :class:`StoreStats`.

The layout (``docs/ARCHITECTURE.md``): the keys, errors, wire and settings every part
shares here; ``local/`` (the store in one process, ``local/disk/`` its LMDB tier),
``server/``, ``client/`` and ``cluster/``, each exporting its surface.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy
from ._contract import BlockStore
from ._errors import (
    BlockCorrupt,
    BlockNotFound,
    BlockPinned,
    IncompatibleStore,
    InvalidBlock,
    InvalidKey,
    InvalidTokens,
    LeaseExpired,
    StoreClosed,
    StoreCorrupt,
    StoreError,
    StoreFull,
    TierUnavailable,
)
from ._keys import KEY_BYTES, BlockKey, HashAlgo, InvalidNamespace, prefix_hashes
from ._lease import Lease
from ._lineage import MAX_BLOCK_TOKENS, TOKEN_BYTES, BadLineage, Lineage
from ._sizes import parse_size
from ._stats import StoreStats, TierStats
from ._stream import TICKET_PREFIX as EVENT_TICKET_PREFIX
from ._stream import KeySnapshot, MalformedEvent, Message, Noted, Subscription
from ._stream import decode as decode_events
from ._stream import encode as encode_events
from ._stream import pack as pack_events
from ._wire import (
    DEFAULT_PORT,
    BadRequest,
    InternalError,
    NotPermitted,
    TooManyRequests,
    UnknownNamespace,
)
from .local import TieredStore
from .settings import ConfigError, read_secret

if TYPE_CHECKING:
    from .client import EventSubscriber, KeyMirror, StoreClient, SubscriptionLost
    from .cluster import ClusterClient, ClusterRegion
    from .server import CacheServer, ServerConfig, load_config

_LAZY = {
    "StoreClient": ".client",
    "KeyMirror": ".client",
    "EventSubscriber": ".client",
    "SubscriptionLost": ".client",
    "ClusterClient": ".cluster",
    "ClusterRegion": ".cluster",
    "CacheServer": ".server",
    "ServerConfig": ".server",
    "load_config": ".server",
}
"""The client, the cluster and the server load on first use (the transfer engine, pyzmq,
prometheus-client): ``import kvbridge.store`` for a local store does not pay for them."""


__getattr__ = lazy(__name__, _LAZY, globals())


__all__ = [
    "DEFAULT_PORT",
    "EVENT_TICKET_PREFIX",
    "KEY_BYTES",
    "MAX_BLOCK_TOKENS",
    "TOKEN_BYTES",
    "BadLineage",
    "BadRequest",
    "BlockCorrupt",
    "BlockKey",
    "BlockNotFound",
    "BlockPinned",
    "BlockStore",
    "CacheServer",
    "ClusterClient",
    "ClusterRegion",
    "ConfigError",
    "EventSubscriber",
    "HashAlgo",
    "IncompatibleStore",
    "InternalError",
    "InvalidBlock",
    "InvalidKey",
    "InvalidNamespace",
    "InvalidTokens",
    "KeyMirror",
    "KeySnapshot",
    "Lease",
    "LeaseExpired",
    "Lineage",
    "MalformedEvent",
    "Message",
    "NotPermitted",
    "Noted",
    "ServerConfig",
    "StoreClient",
    "StoreClosed",
    "StoreCorrupt",
    "StoreError",
    "StoreFull",
    "StoreStats",
    "Subscription",
    "SubscriptionLost",
    "TierStats",
    "TierUnavailable",
    "TieredStore",
    "TooManyRequests",
    "UnknownNamespace",
    "decode_events",
    "encode_events",
    "load_config",
    "pack_events",
    "parse_size",
    "prefix_hashes",
    "read_secret",
]
