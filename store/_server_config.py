"""Cache server settings: command-line flags, then a TOML file, then ``KVBRIDGE_*`` variables,
then the embedded defaults (host memory only, 127.0.0.1, port 7600).

TOML (``kvbridge serve --config server.toml``), every key optional, top level or under
``[server]``::

    host = "127.0.0.1"
    port = 7600
    host_capacity = "4GiB"
    disk_path = "/var/cache/kvbridge"
    disk_capacity = "100GiB"
    metrics_port = 9400
    max_namespaces = 4
    lease_ttl = 60.0
    handoff_ttl = 5.0
    max_leases_per_client = 256
    policy = "reuse"
    transports = ["tcp"]
    secret_file = "/etc/kvbridge/secret"
    insecure = false

Environment: the same names upper-cased with a ``KVBRIDGE_`` prefix (``KVBRIDGE_PORT=7601``,
``KVBRIDGE_HOST_CAPACITY=8GiB``, ``KVBRIDGE_TRANSPORTS=ucx,tcp``), plus ``KVBRIDGE_SECRET``
holding the secret itself.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ._policy import POLICIES
from ._sizes import parse_size

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DEFAULT_PORT = 7600
ENV_PREFIX = "KVBRIDGE_"
_LOOPBACK = ("127.0.0.1", "::1", "localhost")


class ConfigError(ValueError):
    """A setting is unknown, malformed or unsafe; the message names where it came from."""


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    host_capacity: int = 2 << 30
    """Bytes of host memory for all namespaces together (each gets an equal share)."""
    disk_path: str | None = None
    disk_capacity: int = 0
    metrics_port: int | None = None
    """Prometheus metrics over HTTP on ``host``; ``None`` for none."""
    max_namespaces: int = 4
    """Namespaces served at once; each gets ``1/max_namespaces`` of each capacity."""
    lease_ttl: float = 60.0
    """Seconds a staged put or a pinned read stays valid: more than any transfer timeout."""
    max_leases_per_client: int = 256
    handoff_ttl: float = 5.0
    """Seconds a committed block is held for its first read (decode pulling what prefill
    pushed); 0 turns it off. Capped at ``lease_ttl``."""
    policy: str = "reuse"
    """Eviction policy of every tier (``reuse``, ``lru``, ``fifo``: see ``POLICIES``).
    ``reuse`` beat LRU at every capacity replayed on both Mooncake traces."""
    transports: tuple[str, ...] = ("tcp",)
    secret: bytes | None = None
    insecure: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be 0..65535, got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"metrics_port must be 0..65535, got {self.metrics_port}")
        if self.max_namespaces < 1 or self.max_leases_per_client < 1:
            raise ConfigError("max_namespaces and max_leases_per_client must be at least 1")
        if not self.lease_ttl > 0:
            raise ConfigError(f"lease_ttl must be positive, got {self.lease_ttl}")
        if not self.handoff_ttl >= 0:
            raise ConfigError(f"handoff_ttl must not be negative, got {self.handoff_ttl}")
        if self.host_capacity <= 0:
            raise ConfigError("host_capacity must be positive: the server needs host memory")
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {self.policy!r}; choose from {sorted(POLICIES)}")
        if (self.disk_path is None) != (self.disk_capacity == 0):
            raise ConfigError("disk_path and disk_capacity go together")
        if self.secret is None and not self.insecure and self.host not in _LOOPBACK:
            raise ConfigError(
                f"refusing to serve on {self.host} without a secret: give --secret-file "
                "(or KVBRIDGE_SECRET), or --insecure to allow anyone who can reach it"
            )


_SIZES = {"host_capacity", "disk_capacity"}
_INTS = {"port", "metrics_port", "max_namespaces", "max_leases_per_client"}
_FLOATS = {"lease_ttl", "handoff_ttl"}
_BOOLS = {"insecure"}
_FIELDS = {f.name for f in fields(ServerConfig)} - {"secret"} | {"secret_file"}


def load_config(
    flags: Mapping[str, Any] | None = None,
    config_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServerConfig:
    """Merge the sources (flags win, then the file, then the environment); ``None`` values
    in ``flags`` mean "not given". Raises :class:`ConfigError` naming the bad setting."""
    env = os.environ if environ is None else environ
    layers: list[tuple[str, dict[str, Any]]] = [("environment", _from_env(env))]
    if config_file is not None:
        layers.append((str(config_file), _from_toml(Path(config_file))))
    layers.append(("flags", {k: v for k, v in (flags or {}).items() if v is not None}))
    merged: dict[str, Any] = {}
    for source, layer in layers:
        for name, value in layer.items():
            try:
                merged[name] = _convert(name, value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{source}: {name}: {exc}") from None
    secret_file = merged.pop("secret_file", None)
    secret = merged.pop("secret", None)
    if secret_file is not None:
        secret = Path(secret_file).read_bytes().strip()
        if not secret:
            raise ConfigError(f"{secret_file} is empty")
    try:
        return ServerConfig(**merged, secret=secret)
    except TypeError as exc:
        raise ConfigError(str(exc)) from None


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name in _FIELDS | {"secret"}:
        value = env.get(ENV_PREFIX + name.upper())
        if value is not None and value != "":
            found[name] = value.encode() if name == "secret" else value
    return found


def _from_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    table = data.get("server", data)
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [server] must be a table")
    unknown = sorted(set(table) - _FIELDS - {"server"})
    if unknown:
        raise ConfigError(f"{path}: unknown settings {unknown}; known: {sorted(_FIELDS)}")
    return {k: v for k, v in table.items() if k != "server"}


def _convert(name: str, value: Any) -> Any:
    if name in _SIZES:
        return parse_size(value)
    if name in _INTS:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError(f"not an integer: {value!r}")
        return int(value)
    if name in _FLOATS:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ValueError(f"not a number: {value!r}")
        return float(value)
    if name in _BOOLS:
        if isinstance(value, str):
            if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(f"not a boolean: {value!r}")
            return value.lower() in ("1", "true", "yes")
        return bool(value)
    if name == "transports":
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple) or not items:
            raise ValueError(f"not a list of transports: {value!r}")
        return tuple(str(t).strip() for t in items)
    if name in ("host", "disk_path", "secret_file", "policy"):
        return str(value)
    return value
