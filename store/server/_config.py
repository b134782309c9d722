"""Cache server settings: command-line flags, then a TOML file, then ``KVBRIDGE_*`` variables,
then the embedded defaults (host memory only, 127.0.0.1, port 7600).

TOML (``kvbridge serve --config server.toml``), every key optional, top level or under
``[server]``::

    host = "127.0.0.1"
    port = 7600
    data_port = 7601          # TCP data streams; 0 (the default): any free port
    host_capacity = "4GiB"
    disk_path = "/var/cache/kvbridge"
    disk_capacity = "100GiB"
    metrics_port = 9400
    events_port = 7602        # the namespaces' event streams (docs/EVENTS.md)
    events_hwm = 1000         # messages queued per subscriber at most (bytes bound them first)
    events_queue_bytes = "2MiB"   # what one subscriber's queue holds before it is dropped
    events_memory = "256MiB"  # every subscriber together (126 of 2 MiB each)
    max_namespaces = 4
    lease_ttl = 60.0
    handoff_ttl = 5.0
    write_only_alarm = 600.0  # seconds of growth with no block delivered: logged, gauged
    keepalive = 5.0
    max_leases_per_client = 256
    policy = "reuse"
    transports = ["tcp"]
    secret_file = "/etc/kvbridge/secret"
    tenants_file = "/etc/kvbridge/tenants.toml"   # kvbridge serve --tenants
    insecure = false

Environment: the same names upper-cased with a ``KVBRIDGE_`` prefix (``KVBRIDGE_PORT=7601``,
``KVBRIDGE_HOST_CAPACITY=8GiB``, ``KVBRIDGE_TRANSPORTS=ucx,tcp``), plus ``KVBRIDGE_SECRET``
holding the secret itself.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._wire import DEFAULT_PORT
from ..local._policy import POLICIES
from ..settings import (
    MAX_SECONDS,
    ConfigError,
    Flag,
    Kind,
    Names,
    Seconds,
    Size,
    Text,
    Whole,
    parse_settings,
    read_secret,
)
from ._event_bounds import MESSAGES_CAP, QUEUE_BYTES, SERVER_BYTES, EventBounds
from ._tenants import Tenant, TenantError, load_tenants

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ENV_PREFIX = "KVBRIDGE_"
_LOOPBACK = ("127.0.0.1", "::1", "localhost")

SERVER_TRANSPORTS = ("tcp", "ucx", "nixl", "auto")
"""What a server may offer: ``memory`` reaches only engines in its own process, which no
client of a ``kvbridge serve`` is. ``auto`` stands alone (it picks ``ucx`` then ``tcp``).
``nixl`` is one-sided: clients write and read the slab themselves, so it is refused with
tenants (one trust domain only; docs/ACCESS.md)."""
MIN_BLOCK_BYTES = 4096
"""The smallest block a client may open: per-slot bookkeeping (about 100 bytes) stays under
3% of the memory it tracks (1-byte blocks made one ``open`` cost 10x the capacity). Each
namespace's share of every capacity must hold at least one, or every client is refused."""
MIN_KEEPALIVE_S = 0.05
"""The engine's shortest keepalive interval (a peer answers within a round trip)."""
MAX_TTL_S = MAX_SECONDS
"""Longest lease or handoff: a lease outlives a client that died, holding its slots that
long; beyond a day (let alone ``inf``) it is a leak, not a setting."""


@dataclass(frozen=True)
class ServerConfig:
    """Every setting is checked when the object is built (:class:`ConfigError` names the
    first bad one): the server either starts with settings every client can use, or not."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    """The control port: where clients connect, and learn the data port from."""
    data_port: int = 0
    """The TCP transport's data streams; 0: a free port, chosen at start (set one where a
    firewall must name it). UCX picks its own ports (README, "Ports")."""
    host_capacity: int = 2 << 30
    """Bytes of host memory for all namespaces together (each gets an equal share); at most
    the machine's physical memory."""
    disk_path: str | None = None
    """A directory, or a path where one can be created (the server creates it)."""
    disk_capacity: int = 0
    """Bytes of disk for all namespaces together, their LMDB files whole (each namespace's
    share bounds its files; a namespace reclaimed from memory keeps its files only while
    the namespaces on disk stay within it)."""
    metrics_port: int | None = None
    """Prometheus metrics over HTTP on ``host``; ``None`` for none."""
    events_port: int | None = None
    """The namespaces' event streams (ZMQ ROUTER on ``host``: ``docs/EVENTS.md``); ``None``
    for none, 0 for any free port."""
    events_hwm: int = MESSAGES_CAP
    """Messages queued for one subscriber at most (``events_queue_bytes`` usually makes it
    fewer); a subscriber whose queue is full is dropped, and resyncs."""
    events_queue_bytes: int = QUEUE_BYTES
    """Bytes one subscriber's queue holds on the server (``docs/EVENTS.md``, "Bounds"): its
    messages (at most 41 KiB each), so ``events_hwm`` at most ``events_queue_bytes`` /
    41 KiB - 1; its connection and kernel buffer come on top."""
    events_memory: int = SERVER_BYTES
    """Bytes every subscriber together holds: the server's subscribers (and tickets that
    may become one) are this over one subscriber's bound, shared among the tenants."""
    max_namespaces: int = 4
    """Namespaces served at once; each gets ``1/max_namespaces`` of each capacity."""
    lease_ttl: float = 60.0
    """Seconds a staged put or a pinned read stays valid: more than any transfer timeout."""
    max_leases_per_client: int = 256
    handoff_ttl: float = 5.0
    """Seconds a committed block is held for its first read (decode pulling what prefill
    pushed); 0 turns it off. Capped at ``lease_ttl``."""
    write_only_alarm: float = 600.0
    """Seconds a namespace's stored bytes may grow while it delivers no block before it is
    logged (once) and gauged as write-only (``_served``); 0 turns the alarm off."""
    policy: str = "reuse"
    """Eviction policy of every tier (``reuse``, ``lru``, ``fifo``: see ``POLICIES``).
    ``reuse`` beat LRU at every capacity replayed on both Mooncake traces."""
    transports: tuple[str, ...] = ("tcp",)
    """Among :data:`SERVER_TRANSPORTS`, in order of preference."""
    keepalive: float = 5.0
    """Seconds between the frames the server asks of an idle client's streams (a PING when
    it has nothing else to send); a client silent for three of them (killed, frozen, its
    host gone) loses its streams, and with them its session and leases. 0 turns it off
    (a dead client is then noticed only where the transport says so: TCP, not UCX shared
    memory)."""
    secret: bytes | None = None
    """The shared secret of the default tenant; with ``tenants``, the operator's own (it
    opens the metrics endpoint and no namespace)."""
    tenants: tuple[Tenant, ...] | None = None
    """Principals with a secret each, the namespaces each may open and its share of the
    server (``store/server/_tenants.py``); ``None``: one tenant, the shared secret's."""
    insecure: bool = False

    def __post_init__(self) -> None:
        for name, kind in _KINDS.items():
            value = getattr(self, name, None)
            if value is not None or name not in _OPTIONAL:
                kind.check(name, value)
        _check_network(self)
        _check_capacities(self)
        _check_events(self)
        _check_disk_path(self.disk_path)
        if 0 < self.keepalive < MIN_KEEPALIVE_S:
            raise ConfigError(
                f"keepalive must be 0 (off) or at least {MIN_KEEPALIVE_S} s", setting="keepalive"
            )
        if self.policy not in POLICIES:
            raise ConfigError(
                f"unknown policy {self.policy!r}; choose from {sorted(POLICIES)}", setting="policy"
            )
        _check_transports(self.transports)
        _check_security(self)


_PORT = Whole(0, 65535)
_KINDS: dict[str, Kind] = {
    "host": Text(),
    "port": _PORT,
    "data_port": _PORT,
    "metrics_port": _PORT,
    "events_port": _PORT,
    "events_hwm": Whole(1),
    "events_queue_bytes": Size(1),
    "events_memory": Size(1),
    "host_capacity": Size(1),
    "disk_path": Text(),
    "disk_capacity": Size(0),
    "max_namespaces": Whole(1),
    "lease_ttl": Seconds(),
    "max_leases_per_client": Whole(1),
    "handoff_ttl": Seconds(zero_ok=True),
    "write_only_alarm": Seconds(zero_ok=True),
    "policy": Text(),
    "transports": Names(),
    "keepalive": Seconds(zero_ok=True),
    "insecure": Flag(),
}
"""Each setting's kind and bounds (``store/settings.py``); the checks across settings
follow in ``__post_init__``."""
_OPTIONAL = {"metrics_port", "events_port", "disk_path"}
"""Settings that ``None`` turns off."""


def _check_network(cfg: ServerConfig) -> None:
    host = cfg.host
    if any(c.isspace() or c in "/[]" for c in host):
        raise ConfigError(
            f"host must be an address or host name to bind, got {host!r}", setting="host"
        )
    ports = {
        "port": cfg.port,
        "data_port": cfg.data_port,
        "metrics_port": cfg.metrics_port,
        "events_port": cfg.events_port,
    }
    taken: dict[int, str] = {}
    for name, port in ports.items():
        if port:  # 0 (any free port) and None (none) clash with nothing
            if port in taken:
                raise ConfigError(f"{name} and {taken[port]} are both {port}", setting=name)
            taken[port] = name


def _check_capacities(cfg: ServerConfig) -> None:
    namespaces = cfg.max_namespaces
    host = cfg.host_capacity
    if host < namespaces * MIN_BLOCK_BYTES:
        raise ConfigError(
            f"host_capacity {host} gives {namespaces} namespaces no block each",
            setting="host_capacity",
        )
    physical = _physical_memory()
    if physical is not None and host > physical:
        raise ConfigError(
            f"host_capacity {host} is more than this machine's memory ({physical} bytes)",
            setting="host_capacity",
        )
    disk = cfg.disk_capacity
    if (cfg.disk_path is None) != (disk == 0):
        raise ConfigError("disk_path and disk_capacity go together", setting="disk_path")
    if disk:
        from ..local.disk._tier import blocks_within  # noqa: PLC0415  (LMDB only with a disk tier)
        from ._disk_dirs import FILES_BESIDE_DATA  # noqa: PLC0415

        if not blocks_within(disk // namespaces - FILES_BESIDE_DATA, MIN_BLOCK_BYTES):
            raise ConfigError(
                f"disk_capacity {disk} gives each of {namespaces} namespaces "
                f"{disk // namespaces} bytes, which hold no block beside LMDB's records",
                setting="disk_capacity",
            )


def _check_events(cfg: ServerConfig) -> None:
    problem = event_bounds(cfg).problem()
    if problem is not None:
        raise ConfigError(problem[1], setting=problem[0])


def event_bounds(cfg: ServerConfig | Mapping[str, Any]) -> EventBounds:
    """What the event streams' subscribers may hold under these settings (a config, or the
    settings merged so far: those not given are the defaults)."""
    given = cfg if isinstance(cfg, Mapping) else vars(cfg)
    return EventBounds(
        queue_bytes=given.get("events_queue_bytes", QUEUE_BYTES),
        server_bytes=given.get("events_memory", SERVER_BYTES),
        messages=given.get("events_hwm", MESSAGES_CAP),
    )


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # not a POSIX system that says
        return None


def _check_disk_path(disk_path: object) -> None:
    if disk_path is None:
        return
    assert isinstance(disk_path, str)  # checked by its kind
    path = Path(disk_path)
    if path.exists() and not path.is_dir():
        raise ConfigError(
            f"disk_path {disk_path} exists and is not a directory", setting="disk_path"
        )
    existing = next((p for p in (path, *path.absolute().parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise ConfigError(
            f"disk_path {disk_path}: {existing} is not a directory", setting="disk_path"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"disk_path {disk_path}: {existing} is not writable", setting="disk_path")


def _check_transports(transports: tuple[str, ...]) -> None:
    unknown = [t for t in transports if t not in SERVER_TRANSPORTS]
    if unknown:
        raise ConfigError(
            f"unknown transports {unknown}; a server offers {SERVER_TRANSPORTS}",
            setting="transports",
        )
    if len(set(transports)) != len(transports) or ("auto" in transports and len(transports) > 1):
        raise ConfigError(
            f"transports {list(transports)}: each once, and 'auto' alone", setting="transports"
        )


def _check_security(cfg: ServerConfig) -> None:
    if cfg.secret is not None and (not isinstance(cfg.secret, bytes) or not cfg.secret):
        raise ConfigError("secret must be non-empty bytes", setting="secret")
    if cfg.tenants is not None:
        _check_tenants(cfg)
        if "nixl" in cfg.transports:
            raise ConfigError(
                "nixl is one-sided (a client writes and reads the server's memory itself, "
                "which no lease can bound): it serves one trust domain, not tenants",
                setting="transports",
            )
        return  # every tenant proves a secret of its own
    if cfg.secret is None and not cfg.insecure and cfg.host not in _LOOPBACK:
        raise ConfigError(
            f"refusing to serve on {cfg.host} without a secret: give --secret-file "
            "(or KVBRIDGE_SECRET), or --insecure to allow anyone who can reach it",
            setting="secret",
        )


def _check_tenants(cfg: ServerConfig) -> None:
    tenants = cfg.tenants
    if not isinstance(tenants, tuple) or not tenants:
        raise ConfigError("tenants must be a non-empty tuple of Tenant", setting="tenants")
    if not all(isinstance(t, Tenant) and t.secret for t in tenants):
        raise ConfigError("every tenant is a Tenant with a secret", setting="tenants")
    if len({t.name for t in tenants}) != len(tenants):
        raise ConfigError("tenants are named once each", setting="tenants")
    if cfg.metrics_port is not None and cfg.secret is None:
        raise ConfigError(
            "with tenants, the metrics endpoint needs secret_file: the operator's secret, "
            "from which a scrape's token is derived (no tenant's opens it)",
            setting="metrics_port",
        )


_FILES: dict[str, Kind] = {"secret_file": Text(), "tenants_file": Text()}
"""Settings that name a file ``load_config`` reads (the secret, the tenants)."""
_FIELDS = set(_KINDS) | set(_FILES)


def load_config(
    flags: Mapping[str, Any] | None = None,
    config_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServerConfig:
    """Merge the sources (flags win, then the file, then the environment); ``None`` values
    in ``flags`` mean "not given". Raises :class:`ConfigError` naming the bad setting."""
    env = os.environ if environ is None else environ
    layers: list[tuple[str, dict[str, Any], bool]] = [("environment", _from_env(env), True)]
    if config_file is not None:
        layers.append((str(config_file), _from_toml(Path(config_file)), False))
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    layers.append(("flags", given, True))  # argparse: text, or typed by the flag
    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    kinds = {**_KINDS, **_FILES}
    for source, layer, text in layers:
        secret = layer.pop("secret", None)  # only the environment holds the secret itself
        if secret is not None:
            merged["secret"] = secret.strip().encode()
        merged.update(parse_settings(kinds, layer, source=source, text=text))
        origin.update(dict.fromkeys(layer, source))
    secret_file = merged.pop("secret_file", None)
    secret = merged.pop("secret", None)
    if secret_file is not None:
        secret = read_secret(secret_file)
    tenants = _read_tenants(merged.pop("tenants_file", None), merged, origin)
    try:
        return ServerConfig(**merged, secret=secret, tenants=tenants)
    except ConfigError as exc:
        if exc.setting not in origin:  # an embedded default, or the combination
            raise
        raise ConfigError(f"{origin[exc.setting]}: {exc}", setting=exc.setting) from None


def _read_tenants(
    path: str | None, merged: Mapping[str, Any], origin: Mapping[str, str]
) -> tuple[Tenant, ...] | None:
    if path is None:
        return None
    try:
        namespaces = merged.get("max_namespaces", ServerConfig.max_namespaces)
        return load_tenants(path, namespaces, event_bounds(merged).subscribers)
    except TenantError as exc:
        raise ConfigError(
            f"{origin['tenants_file']}: tenants_file: {exc}", setting="tenants"
        ) from None


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name in _FIELDS | {"secret"}:
        value = env.get(ENV_PREFIX + name.upper())
        if value is not None and value != "":
            found[name] = value
    return found


def _from_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}): not a TOML file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    table: Any = data
    if "server" in data:
        table = data["server"]
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: [server] must be a table")
        outside = sorted(set(data) - {"server"})
        if outside:
            raise ConfigError(f"{path}: settings {outside} are outside the [server] table")
    unknown = sorted(set(table) - _FIELDS)
    if unknown:
        raise ConfigError(f"{path}: unknown settings {unknown}; known: {sorted(_FIELDS)}")
    return dict(table)
