"""``kvbridge proxy``'s settings: every limit, with the reason for its default, and the check
of an upstream URL. Pure: no aiohttp here, so the command line checks its flags before it
imports anything."""

from __future__ import annotations

import dataclasses
import math
from urllib.parse import urlsplit

DEFAULT_MAX_BODY = 64 << 20
"""vLLM's server sets no limit on a request body; 64 MiB holds a prompt of millions of token
ids or a chat request with several large base64 images, and still refuses a runaway upload
before it fills the proxy's memory (aiohttp's own default, 1 MiB, refused real requests)."""

DEFAULT_CONNECTIONS_PER_INSTANCE = 1024
"""vLLM's largest default batch (``max_num_seqs`` 1024 on an H100-class GPU, 256 on smaller
ones): a lower bound would cap a decode instance's batch, a higher one only queues requests
inside vLLM. Each connection is a socket: ``kvbridge proxy`` raises its open-files limit."""

DEFAULT_PREFILL_TIMEOUT = 600.0
"""A prefill past it costs its time, then decode computes the prompt: a long prompt behind a
long queue can take minutes, and giving up early wastes the prefill already done."""

DEFAULT_HEALTH_INTERVAL = 2.0
"""A dead instance that no request finds first leaves the rotation within about this long;
one ``GET /health`` per instance per interval costs nothing."""

DEFAULT_HEALTH_TIMEOUT = 5.0
"""vLLM answers ``/health`` from its API server process, whose event loop can lag a second
or two under a full batch: 5 s keeps a busy instance in and takes a hung one out."""

CONNECT_TIMEOUT = 10.0
"""A TCP connect to an instance on the same network takes milliseconds: 10 s is a dead host
(its packets dropped), not a slow one."""

KEEPALIVE_S = 2.0
"""Idle upstream connections close before uvicorn's (vLLM's server) 5 s idle close, so the
proxy seldom sends a request on a connection the server is closing."""

PREFILL_ANSWER_MAX = 8 << 20
"""A one-token prefill answer is a few kB; anything longer is not one (the proxy keeps only
its ``kv_transfer_params``), so it is dropped and decode computes the prompt."""

ATTEMPTS = 2
"""Tries per request and role: a request that got no response status (the connection was
refused, or dropped before an answer) is tried once more, never after a byte came back."""


class SettingError(ValueError):
    """A bad setting; ``name`` is the field's."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"{name} {problem}")
        self.name = name
        self.problem = problem


@dataclasses.dataclass(frozen=True)
class ProxySettings:
    """What ``kvbridge proxy`` can be told; ``SettingError`` names a bad one."""

    max_body: int = DEFAULT_MAX_BODY
    connections_per_instance: int = DEFAULT_CONNECTIONS_PER_INSTANCE
    prefill_timeout: float = DEFAULT_PREFILL_TIMEOUT
    health_interval: float = DEFAULT_HEALTH_INTERVAL
    health_timeout: float = DEFAULT_HEALTH_TIMEOUT

    def __post_init__(self) -> None:
        for name in ("max_body", "connections_per_instance"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise SettingError(name, f"must be a positive whole number, got {value!r}")
        for name in ("prefill_timeout", "health_interval", "health_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise SettingError(name, f"must be a positive number of seconds, got {value!r}")


def upstream_url(url: str) -> str:
    """``url`` as the proxy keeps it (no trailing ``/``): ``http(s)://host[:port][/prefix]``,
    else ``ValueError`` saying what is wrong with it."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port  # raises ValueError when out of range or not a number
    except ValueError as exc:
        raise ValueError(f"bad instance URL {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"bad instance URL {url!r}: give http://host:port")
    if not parts.hostname:
        raise ValueError(f"bad instance URL {url!r}: no host")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"bad instance URL {url!r}: no query, fragment or user part")
    if port == 0:
        raise ValueError(f"bad instance URL {url!r}: port 0")
    return url.strip().rstrip("/")


def upstream_urls(role: str, urls: list[str] | tuple[str, ...]) -> list[str]:
    """The checked URLs of one role: at least one, none given twice."""
    checked = [upstream_url(url) for url in urls]
    if not checked:
        raise ValueError(f"no {role} instance given")
    twice = {url for url in checked if checked.count(url) > 1}
    if twice:
        raise ValueError(f"{role} instance {sorted(twice)[0]} given twice")
    return checked
