"""The connector's settings, from an engine's free-form config (vLLM's
``kv_connector_extra_config``): every key checked, an unknown one named."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...store import ConfigError, read_secret
from ...store.cluster import DEFAULT_CLUSTER, EtcdGateway
from ...store.settings import Flag, Kind, Seconds, Size, Text, Whole, parse_settings
from ...transfer import DEFAULT_STREAMS, BadAddress, LocalProtocolError, Principal, parse_address

ETCD_SCHEME = "etcd://"

DEFAULT_STAGING_BYTES = 256 << 20
"""256 MiB: 2,000 tokens of Llama-3-8B's KV (128 KiB a token) per chunk, a few
milliseconds of PCIe; pinned once per worker."""


@dataclass(frozen=True)
class ConnectorConfig:
    """Where the blocks live and how long the connector waits for them.

    With ``server`` the blocks live in a ``kvbridge serve`` (shared by every instance that
    names it); without, in a :class:`~kvbridge.store.TieredStore` inside the engine process
    (one instance's prefix cache, offloaded to host memory and optionally disk).
    """

    server: str | None = None
    """``host:port`` of a ``kvbridge serve``, or ``etcd://HOST:PORT[,HOST:PORT...]``: the
    etcd of a cluster of them (``kvbridge serve --cluster``)."""
    cluster_name: str = DEFAULT_CLUSTER
    """The cluster's name in etcd (``kvbridge serve --cluster-name``), with an ``etcd://``
    server."""
    secret_file: str | None = None
    """The server's shared secret, or the tenant's (a file, so that it never shows in a
    command line)."""
    tenant: str = ""
    """The server's tenant this engine is (``kvbridge serve --tenants``; its secret in
    ``secret_file``): namespaces are then named ``<tenant>/...``, inside the tenant's
    default prefix."""
    host_capacity: int = 1 << 30
    """In-process store: bytes of host memory."""
    disk_path: str | None = None
    """In-process store: an LMDB directory (the cache survives restarts)."""
    disk_capacity: int = 0
    namespace: str = ""
    """Mixed into the namespace, to keep deployments of one model apart."""
    timeout: float = 30.0
    """Seconds any one store call may take before it counts as failed."""
    failed_key_ttl: float = 60.0
    """A key whose load failed is not advertised again for this long (no livelock)."""
    async_load: bool = False
    """Load on a worker thread while the engine runs other requests (the request waits in
    ``WAITING_FOR_REMOTE_KVS``) instead of before the forward of its next step."""
    mirror: bool = True
    """Keep the namespace's keys from the server's event stream (``kvbridge serve
    --events-port``): the scheduler then probes them locally and asks the server only to
    pin a hit. Without a stream (or while the mirror is out of step) it asks the server."""
    lookup_wait: float = 0.05
    """How long the engine's scheduler waits (across its steps, never blocking one) for a
    request's lookup before it computes the prefix itself; a later answer is dropped."""
    pd_wait: float = 10.0
    """Decode side of P/D: how long a request waits for the blocks its prefill announced
    before it computes what is missing itself."""
    streams: int = DEFAULT_STREAMS
    """TCP data streams per connection to the server: more where the machine has the cores
    to drive a fast link (``TransferSettings.streams``)."""
    transports: str = "tcp"
    """How pages travel to the server: ``"tcp"``; ``"ucx"``; ``"nixl"`` (one-sided NIXL
    reads and writes: a server of one trust domain, ``docs/ACCESS.md``); ``"auto"`` (UCX where
    both ends have it, else TCP; where NIXL is installed and ucxx is not, nixl where the
    server offers it, else TCP). A KV cache in GPU memory moves directly over UCX or nixl
    where the transport takes GPU memory, and through the staging buffer otherwise."""
    staging: str = "auto"
    """``"auto"``: pages in GPU memory that the transport cannot take go through a host
    staging buffer, host pages move directly; ``"always"``: every page goes through it."""
    verify: bool = True
    """Check each loaded block against the checksum its writer sent (XXH3-64 of its bytes,
    ``store/_checksums.py``) before calling it loaded: one that fails is a miss from it on
    (recomputed), counted (``tokens_lost_corrupt``) and reported to the server, which drops
    its copy if that is bad too. Saves always send the checksums."""
    staging_bytes: int = DEFAULT_STAGING_BYTES
    """The staging buffer (allocated once, pinned for a GPU cache): a load or save larger
    than it runs in chunks of what it holds."""

    def __post_init__(self) -> None:
        for name, kind in _KINDS.items():
            value = getattr(self, name)
            if value is not None or name not in _OPTIONAL:
                kind.check(name, value)
        if (self.disk_path is None) != (self.disk_capacity == 0):
            raise ConfigError("disk_path and disk_capacity go together")
        if self.server is not None and (self.disk_path is not None):
            raise ConfigError("disk_path is for the in-process store; a server has its own")
        if self.tenant and self.server is None:
            raise ConfigError("tenant is a server's (set server too)", setting="tenant")
        if self.tenant:
            try:
                Principal(self.tenant, b"-")  # the engine's check of a tenant's name
            except LocalProtocolError as exc:
                raise ConfigError(f"tenant: {exc}", setting="tenant") from None
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConfigError(
                    f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}",
                    setting=name,
                )
        if self.server is not None:
            _check_server(self.server)
        if self.cluster_name != DEFAULT_CLUSTER and not self.clustered:
            raise ConfigError(
                "cluster_name is an etcd:// server's (set server too)", setting="cluster_name"
            )

    @property
    def clustered(self) -> bool:
        """Whether ``server`` is a cluster's etcd."""
        return self.server is not None and self.server.startswith(ETCD_SCHEME)

    @property
    def secret(self) -> bytes | None:
        return None if self.secret_file is None else read_secret(self.secret_file)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        """Parse an engine's extra config. Raises :class:`ConfigError` naming an unknown
        key or a value of the wrong kind."""
        given = dict(extra or {})
        unknown = sorted(set(given) - set(_KINDS))
        if unknown:
            raise ConfigError(
                f"unknown kvbridge connector setting(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(_KINDS))}"
            )
        return cls(**parse_settings(_KINDS, given, source="kvbridge connector", text=False))


def _check_server(server: str) -> None:
    """``host:port`` or an etcd URL, or :class:`ConfigError` naming what is wrong."""
    try:
        if server.startswith(ETCD_SCHEME):
            EtcdGateway.from_url(server)  # parses only: etcd is reached when the store is
        else:
            parse_address(server)
    except (BadAddress, ValueError) as exc:
        raise ConfigError(f"server: {exc}", setting="server") from None


_KINDS: dict[str, Kind] = {
    "server": Text(),
    "cluster_name": Text(),
    "secret_file": Text(),
    "tenant": Text(empty_ok=True),
    "host_capacity": Size(0),
    "disk_path": Text(),
    "disk_capacity": Size(0),
    "namespace": Text(empty_ok=True),
    "timeout": Seconds(),
    "failed_key_ttl": Seconds(),
    "async_load": Flag(),
    "mirror": Flag(),
    "verify": Flag(),
    "lookup_wait": Seconds(),
    "pd_wait": Seconds(),
    "streams": Whole(1, 64),
    "transports": Text(),
    "staging": Text(),
    "staging_bytes": Size(1),
}
"""Each setting's kind and bounds (``store/settings.py``, shared with the server's); the
checks across settings follow in ``__post_init__``."""
_CHOICES = {"transports": ("tcp", "ucx", "nixl", "auto"), "staging": ("auto", "always")}

_OPTIONAL = {"server", "secret_file", "disk_path"}
"""Settings that ``None`` leaves unset."""
