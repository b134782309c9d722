"""kvbridge.store: block keys, tiers and the tiered KV-block store.

Public surface:

- :func:`prefix_hashes` and :data:`BlockKey`: chained, deterministic block keys.
- :class:`TieredStore`: device/host/disk tiers with dedup, eviction, pins and checksums;
  :class:`RemoteAccess`, the lease protocol a cache server runs over one (staged puts,
  resident pins, write admission).
- Tiers and their building blocks, for custom stacks: :class:`SlotTier`, :class:`HostSlab`,
  :class:`DeviceSlab`, :class:`DiskTier`, :class:`EvictionPolicy` and the policies.
- The cache server and its client: :class:`CacheServer` (``kvbridge serve``), its
  settings (:class:`ServerConfig`, :func:`load_config`), and :class:`StoreClient`, which has
  the surface of a local :class:`TieredStore`; :class:`ClusterClient`, the same surface
  over a cluster of servers found in etcd (``kvbridge serve --cluster``), with its
  registered buffers (:class:`ClusterRegion`) and pins (:class:`ClusterLease`).
- The namespaces' event streams (``kvbridge serve --events-port``, ``docs/EVENTS.md``):
  :class:`KeyMirror`, a namespace's keys kept from its stream, and
  :class:`EventSubscriber`, one subscription read message by message; :func:`decode_events`, a
  message read (:class:`MalformedEvent` if it is none), :func:`encode_events` and
  :func:`pack_events`, one written; :class:`Subscription` and :class:`KeySnapshot`, what
  :class:`StoreClient` hands a subscriber; :data:`EVENT_TICKET_PREFIX`.
- Tenants (:class:`Tenant`, :func:`load_tenants`, ``kvbridge serve --tenants``): each
  with a secret of its own, the namespaces it may open, and its share of the server.
- Typed errors, all subclasses of :class:`StoreError`.

The layout (``docs/ARCHITECTURE.md``): the keys, errors, wire and settings every part
shares here; ``local/`` (the store in one process, ``local/disk/`` its LMDB tier),
``server/``, ``client/`` and ``cluster/``, each exporting its surface.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy
from ._errors import (
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
from ._sizes import parse_size
from ._stats import StoreStats, TierStats
from ._stream import TICKET_PREFIX as EVENT_TICKET_PREFIX
from ._stream import KeySnapshot, MalformedEvent, Message, Subscription
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
from .local import (
    DEFAULT_PIN_TTL_S,
    FIFO,
    LRU,
    POLICIES,
    CheckReport,
    DeviceSlab,
    DiskTier,
    EvictionPolicy,
    HostSlab,
    Lease,
    RemoteAccess,
    ReuseLRU,
    SlotMemory,
    SlotTier,
    Tier,
    TieredStore,
)
from .settings import ConfigError, read_secret

if TYPE_CHECKING:
    from .client import (
        SERVER_FAULTS,
        ClientPool,
        EventSubscriber,
        KeyMirror,
        Lent,
        StoreClient,
        SubscriptionLost,
    )
    from .cluster import ClusterClient, ClusterLease, ClusterRegion
    from .server import (
        CacheServer,
        ServerConfig,
        Tenant,
        TenantError,
        load_config,
        load_tenants,
        metrics_token,
    )

_LAZY = {
    "StoreClient": ".client",
    "ClientPool": ".client",
    "Lent": ".client",
    "KeyMirror": ".client",
    "EventSubscriber": ".client",
    "SubscriptionLost": ".client",
    "SERVER_FAULTS": ".client",
    "ClusterClient": ".cluster",
    "ClusterLease": ".cluster",
    "ClusterRegion": ".cluster",
    "CacheServer": ".server",
    "ServerConfig": ".server",
    "Tenant": ".server",
    "TenantError": ".server",
    "load_config": ".server",
    "load_tenants": ".server",
    "metrics_token": ".server",
}
"""The client, the cluster and the server load on first use (the transfer engine, pyzmq,
prometheus-client): ``import kvbridge.store`` for a local store does not pay for them."""


__getattr__ = lazy(__name__, _LAZY, globals())


__all__ = [
    "DEFAULT_PIN_TTL_S",
    "DEFAULT_PORT",
    "EVENT_TICKET_PREFIX",
    "FIFO",
    "KEY_BYTES",
    "LRU",
    "POLICIES",
    "SERVER_FAULTS",
    "BadRequest",
    "BlockKey",
    "BlockNotFound",
    "BlockPinned",
    "CacheServer",
    "CheckReport",
    "ClientPool",
    "ClusterClient",
    "ClusterLease",
    "ClusterRegion",
    "ConfigError",
    "DeviceSlab",
    "DiskTier",
    "EventSubscriber",
    "EvictionPolicy",
    "HashAlgo",
    "HostSlab",
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
    "Lent",
    "MalformedEvent",
    "Message",
    "NotPermitted",
    "RemoteAccess",
    "ReuseLRU",
    "ServerConfig",
    "SlotMemory",
    "SlotTier",
    "StoreClient",
    "StoreClosed",
    "StoreCorrupt",
    "StoreError",
    "StoreFull",
    "StoreStats",
    "Subscription",
    "SubscriptionLost",
    "Tenant",
    "TenantError",
    "Tier",
    "TierStats",
    "TierUnavailable",
    "TieredStore",
    "TooManyRequests",
    "UnknownNamespace",
    "decode_events",
    "encode_events",
    "load_config",
    "load_tenants",
    "metrics_token",
    "pack_events",
    "parse_size",
    "prefix_hashes",
    "read_secret",
]
