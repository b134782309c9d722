"""Tenants: who may use a cache server, which namespaces, and how much of it.

A tenant is a principal of the server's engine (``kvbridge.transfer.Principal``): a name
and a secret of its own, proved at every handshake. What a session may do follows from the
tenant it proved, never from what it asks for:

- it opens only namespaces whose names start with one of the tenant's ``namespaces``
  prefixes (another tenant's namespaces, whatever their names, are outside them unless an
  operator gave both tenants the same prefix on purpose: a shared prefix cache);
- a ``read-only`` tenant looks up and reads, and never stages, commits, removes or clears;
- the tenant's sessions together hold at most ``slots`` of each namespace's memory slots,
  ``max_leases`` open leases, ``max_namespaces`` open namespaces, ``max_sessions``
  sessions, ``max_tickets`` unused event tickets and ``max_subscribers`` event
  subscribers (``_event_ledger``): opening more sessions gains a tenant nothing.

Without a tenants file there is one tenant, the default (the engine's default principal):
the server's shared secret (or none, on loopback), every namespace, read-write, and the
whole of each share (the per-request and per-session limits still hold). Its clients trust
each other: a client that must be bounded against another gets a tenant of its own.

The tenants file is TOML (``kvbridge serve --tenants FILE``)::

    [[tenant]]
    name = "team-a"                    # 1-64 letters, digits, '.', '_', '-'
    secret_file = "/etc/kvbridge/a"    # or: secret = "..."
    namespaces = ["team-a/"]           # name prefixes it may open (default: "<name>/")
    access = "read-write"              # or "read-only"
    slots = 0.5                        # of each namespace's memory slots, at once
    max_namespaces = 2                 # open at once (default: max_namespaces / tenants)
    max_sessions = 64
    max_streams = 256                  # default: 1,024 served streams / tenants
    max_leases = 256
    max_tickets = 63                   # unused event tickets; default: 126 subscribers / tenants
    max_subscribers = 63               # event tickets and subscribers together (the same)
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...transfer import DEFAULT_PRINCIPAL, LocalProtocolError, Principal
from ._event_bounds import EventBounds

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

TENANT_SLOT_SHARE = 0.5
"""A tenant of a tenants file holds at most half of each namespace's memory slots at once
unless its entry says otherwise (as one session of the default tenant)."""
TENANT_SESSIONS = 64
"""Sessions a tenant of a tenants file may have at once (a vLLM deployment of 8 workers
with a scheduler each uses 16); the table holds 4,096 in all."""
TENANT_LEASES = 256
"""Open leases a tenant of a tenants file may hold, all namespaces together."""
SERVED_STREAMS = 1024
"""Data streams the server serves at once (``transfer/_served.py``): a tenant of a file gets
an equal part unless its entry says otherwise, so that one tenant's streams never leave
another none."""
SERVER_SUBSCRIBERS = EventBounds().subscribers
"""Event subscribers a server holds with the default settings (126): a tenant of a file
gets an equal part of the server's (and as many tickets) unless its entry says otherwise,
so that one tenant's subscribers never leave another none."""
MAX_TENANTS = 1024
"""Tenants one file may name (each costs a principal and a line of accounting)."""

_KEYS = frozenset(
    {"name", "secret", "secret_file", "namespaces", "access", "slots"}
    | {"max_namespaces", "max_sessions", "max_streams", "max_leases"}
    | {"max_tickets", "max_subscribers"}
)
_ACCESS = ("read-write", "read-only")


class TenantError(ValueError):
    """A tenants file or entry is malformed; the message names the file and the tenant."""


@dataclass(frozen=True)
class Tenant:
    """One principal of a cache server and what its sessions may do (module docstring)."""

    name: str
    secret: bytes | None
    namespaces: tuple[bytes, ...] = (b"",)
    """Prefixes of the namespace names it may open (``b""``: every name)."""
    read_only: bool = False
    slots: float = 1.0
    max_namespaces: int | None = None
    """``None``: as many as the server serves."""
    max_sessions: int | None = TENANT_SESSIONS
    """``None``: as many as the server's engine holds."""
    max_streams: int | None = None
    """Data streams of its sessions together; ``None``: as many as the server serves."""
    max_leases: int | None = None
    """``None``: no bound beyond each session's (``max_leases_per_client``)."""
    max_tickets: int | None = None
    """Unused event tickets of its sessions together; ``None``: the server's bound."""
    max_subscribers: int | None = None
    """Event subscribers of its sessions together, the tickets that may become one
    included; ``None``: the server's bound."""

    @property
    def label(self) -> str:
        return self.name or "default"

    def may_open(self, namespace: bytes) -> bool:
        return any(namespace.startswith(prefix) for prefix in self.namespaces)

    def principal(self) -> Principal:
        if self.max_sessions is None:
            return Principal(self.name, self.secret, max_streams=self.max_streams)
        return Principal(self.name, self.secret, self.max_sessions, self.max_streams)


def default_tenant(secret: bytes | None) -> Tenant:
    """The one tenant of a server without a tenants file."""
    return Tenant(DEFAULT_PRINCIPAL, secret, max_sessions=None)


def load_tenants(
    path: str | Path, server_namespaces: int, server_subscribers: int = SERVER_SUBSCRIBERS
) -> tuple[Tenant, ...]:
    """The tenants of a TOML file; :class:`TenantError` naming the file and the entry.
    The defaults of the shares are equal parts of ``server_namespaces`` and of
    ``server_subscribers`` (``EventBounds.subscribers``)."""
    file = Path(path)
    try:
        data = tomllib.loads(file.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise TenantError(f"{file}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise TenantError(f"{file}: not a TOML file: {exc}") from None
    entries = data.get("tenant")
    outside = sorted(set(data) - {"tenant"})
    if outside or not isinstance(entries, list) or not entries:
        raise TenantError(f"{file}: expected [[tenant]] tables only (found {outside or 'none'})")
    if len(entries) > MAX_TENANTS:
        raise TenantError(f"{file}: {len(entries)} tenants; at most {MAX_TENANTS}")
    shares = _Shares(
        namespaces=max(1, server_namespaces // len(entries)),
        streams=max(1, SERVED_STREAMS // len(entries)),
        subscribers=max(1, server_subscribers // len(entries)),
    )
    tenants = [_tenant(file, entry, shares) for entry in entries]
    names = [t.name for t in tenants]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise TenantError(f"{file}: tenants named more than once: {twice}")
    return tuple(tenants)


@dataclass(frozen=True)
class _Shares:
    """A tenant's part of what the server holds, where its entry does not say."""

    namespaces: int
    streams: int
    subscribers: int


def _tenant(file: Path, entry: object, shares: _Shares) -> Tenant:
    if not isinstance(entry, dict):
        raise TenantError(f"{file}: a [[tenant]] entry must be a table")
    where = f"{file}: tenant {entry.get('name', '?')!r}"
    unknown = sorted(set(entry) - _KEYS)
    if unknown:
        raise TenantError(f"{where}: unknown settings {unknown}; known: {sorted(_KEYS)}")
    try:
        name = _name(entry.get("name"))
        return Tenant(
            name=name,
            secret=_secret(entry, file.parent),
            namespaces=_prefixes(entry.get("namespaces", [f"{name}/"])),
            read_only=_access(entry.get("access", "read-write")),
            slots=_share(entry.get("slots", TENANT_SLOT_SHARE)),
            max_namespaces=_whole("max_namespaces", entry.get("max_namespaces", shares.namespaces)),
            max_sessions=_whole("max_sessions", entry.get("max_sessions", TENANT_SESSIONS)),
            max_streams=_whole("max_streams", entry.get("max_streams", shares.streams)),
            max_leases=_whole("max_leases", entry.get("max_leases", TENANT_LEASES)),
            max_tickets=_whole("max_tickets", entry.get("max_tickets", shares.subscribers)),
            max_subscribers=_whole(
                "max_subscribers", entry.get("max_subscribers", shares.subscribers)
            ),
        )
    except (TypeError, ValueError, LocalProtocolError) as exc:
        raise TenantError(f"{where}: {exc}") from None


def _name(value: object) -> str:
    if value == DEFAULT_PRINCIPAL or not isinstance(value, str):
        raise ValueError("name is a non-empty string")
    Principal(value, b"x")  # the engine's own check of a principal's name
    return value


def _secret(entry: Mapping[str, Any], folder: Path) -> bytes:
    given = [key for key in ("secret", "secret_file") if key in entry]
    if len(given) != 1:
        raise ValueError("give secret or secret_file (one of them)")
    if given[0] == "secret":
        value = entry["secret"]
        if not isinstance(value, str) or not value.strip():
            raise ValueError("secret is a non-empty string")
        return value.strip().encode()
    path = entry["secret_file"]
    if not isinstance(path, str):
        raise ValueError("secret_file is a path")
    try:
        secret = (folder / path).read_bytes().strip()  # relative to the tenants file
    except OSError as exc:
        raise ValueError(f"secret_file {path}: {exc.strerror or exc}") from None
    if not secret:
        raise ValueError(f"secret_file {path} is empty")
    return secret


def _prefixes(value: object) -> tuple[bytes, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(p, str) for p in value):
        raise ValueError("namespaces is a non-empty list of name prefixes")
    return tuple(p.encode() for p in value)


def _access(value: object) -> bool:
    if value not in _ACCESS:
        raise ValueError(f"access is one of {list(_ACCESS)}, got {value!r}")
    return value == "read-only"


def _share(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"slots is a fraction, got {value!r}")
    if not (math.isfinite(value) and 0 < value <= 1):
        raise ValueError(f"slots must be more than 0 and at most 1, got {value}")
    return float(value)


def _whole(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} is a whole number of at least 1, got {value!r}")
    return value
