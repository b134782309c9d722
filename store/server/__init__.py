"""kvbridge.store.server: the cache server (``kvbridge serve``).

:class:`CacheServer` dispatches a client's requests to its namespaces (``_namespaces``:
one store each, and its lease ledger, ``_ledger``; ``_namespace_table``:
opening, quotas, reclaiming), within each tenant's rights and shares (``_tenants``), under
the settings of :class:`ServerConfig` (``_config``: flags, TOML, environment), with
Prometheus metrics (``_metrics``, ``_metrics_http``) and its disk directories bounded
(``_disk_dirs``). Imports ``local`` (the stores) and the wire; never ``client``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..._lazy import lazy

if TYPE_CHECKING:
    from ._config import MIN_BLOCK_BYTES, SERVER_TRANSPORTS, ServerConfig, load_config
    from ._lease_counts import LeaseCounts
    from ._ledger import Leases
    from ._metrics import metrics_token
    from ._server import CacheServer
    from ._tenants import Tenant, TenantError, load_tenants

_LAZY = {
    "MIN_BLOCK_BYTES": "._config",
    "SERVER_TRANSPORTS": "._config",
    "ServerConfig": "._config",
    "load_config": "._config",
    "LeaseCounts": "._lease_counts",
    "Leases": "._ledger",
    "metrics_token": "._metrics",
    "CacheServer": "._server",
    "Tenant": "._tenants",
    "TenantError": "._tenants",
    "load_tenants": "._tenants",
}
"""Loaded on first use: the package's modules load the transfer engine (pyzmq, threads)."""

__getattr__ = lazy(__name__, _LAZY, globals())

__all__ = [
    "MIN_BLOCK_BYTES",
    "SERVER_TRANSPORTS",
    "CacheServer",
    "LeaseCounts",
    "Leases",
    "ServerConfig",
    "Tenant",
    "TenantError",
    "load_config",
    "load_tenants",
    "metrics_token",
]
