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
  over a cluster of servers found in etcd (``kvbridge serve --cluster``).
- Tenants (:class:`Tenant`, :func:`load_tenants`, ``kvbridge serve --tenants``): each
  with a secret of its own, the namespaces it may open, and its share of the server.
- Typed errors, all subclasses of :class:`StoreError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy
from ._disk import CheckReport, DiskTier
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
from ._pins import DEFAULT_PIN_TTL_S, Lease
from ._policy import FIFO, LRU, POLICIES, EvictionPolicy, ReuseLRU
from ._remote import RemoteAccess
from ._sizes import parse_size
from ._slab import DeviceSlab, HostSlab, SlotMemory
from ._slots import SlotTier
from ._stats import StoreStats, TierStats
from ._store import TieredStore
from ._tier import Tier

if TYPE_CHECKING:
    from ._client import StoreClient
    from ._cluster_client import ClusterClient
    from ._metrics import metrics_token
    from ._server import CacheServer
    from ._server_config import DEFAULT_PORT, ConfigError, ServerConfig, load_config
    from ._tenants import Tenant, TenantError, load_tenants
    from ._wire import BadRequest, InternalError, NotPermitted, TooManyRequests, UnknownNamespace

_LAZY = {
    "StoreClient": "._client",
    "ClusterClient": "._cluster_client",
    "CacheServer": "._server",
    "metrics_token": "._metrics",
    "DEFAULT_PORT": "._server_config",
    "ConfigError": "._server_config",
    "ServerConfig": "._server_config",
    "load_config": "._server_config",
    "BadRequest": "._wire",
    "InternalError": "._wire",
    "TooManyRequests": "._wire",
    "NotPermitted": "._wire",
    "Tenant": "._tenants",
    "TenantError": "._tenants",
    "load_tenants": "._tenants",
    "UnknownNamespace": "._wire",
}
"""The client and the server load on first use: a plain store user does not pay for
pyzmq, prometheus-client and the transfer engine (``python -X importtime``: 96 ms for
``import kvbridge.store`` on the development machine, 229 ms when they loaded eagerly)."""


__getattr__ = lazy(__name__, _LAZY, globals())


__all__ = [
    "DEFAULT_PIN_TTL_S",
    "DEFAULT_PORT",
    "FIFO",
    "KEY_BYTES",
    "LRU",
    "POLICIES",
    "BadRequest",
    "BlockKey",
    "BlockNotFound",
    "BlockPinned",
    "CacheServer",
    "CheckReport",
    "ClusterClient",
    "ConfigError",
    "DeviceSlab",
    "DiskTier",
    "EvictionPolicy",
    "HashAlgo",
    "HostSlab",
    "IncompatibleStore",
    "InternalError",
    "InvalidBlock",
    "InvalidKey",
    "InvalidNamespace",
    "InvalidTokens",
    "Lease",
    "LeaseExpired",
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
    "Tenant",
    "TenantError",
    "Tier",
    "TierStats",
    "TierUnavailable",
    "TieredStore",
    "TooManyRequests",
    "UnknownNamespace",
    "load_config",
    "load_tenants",
    "metrics_token",
    "parse_size",
    "prefix_hashes",
]
