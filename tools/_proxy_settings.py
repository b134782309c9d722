"""``kvbridge proxy``'s settings: every limit, with the reason for its default, the check of
an upstream URL, and how many client connections the open-files limit has room for. No
aiohttp here, so the command line checks its flags before it imports anything."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from urllib.parse import urlsplit

from kvbridge.transfer import open_files_limit

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

KV_SLACK = 4
"""``--route kv``: requests an instance may have outstanding beyond the least busy one's and
still be chosen for its cache: enough that a cached prefix wins over a small queue, few
enough that one prefix shared by every request cannot pile them all on one instance."""


def kv_score(scores: Mapping[str, int], url: str) -> int:
    """``--route kv``: the prompt's tokens the instance at ``url`` holds or can load
    (``scores[""]``: what any instance can load from the shared tiers)."""
    return scores.get(url, scores.get("", 0))


DEFAULT_HEAD_TIMEOUT = 10.0
"""A client sends a request head (its line and headers, a few kB) in one round trip; 10 s is
a client on a very poor link, and past it the connection is someone holding a socket open
with half a head (slowloris). A body that stops for this long is cut too."""

DEFAULT_IDLE_TIMEOUT = 60.0
"""An idle keep-alive connection is closed after this long. Clients close theirs sooner
(httpx, the OpenAI SDK's client: 5 s; aiohttp: 15 s), so the proxy seldom closes one a
client is about to send on; a client that keeps one longer opens a new one."""

LISTEN_BACKLOG = 1024
"""Connections the kernel queues before the proxy accepts them (capped by the kernel's
somaxconn): a burst of clients is queued, not refused (aiohttp's default is 128)."""

ACCEPTS_PER_TURN = 128
"""Connections the event loop accepts in one turn (asyncio accepts as many as the backlog
it listens with; the proxy sets the kernel's queue to ``LISTEN_BACKLOG`` after). Well below
the cap, so that a client accepted in a burst is read before the strangers accepted behind
it push it out as the quietest: with 1,024 a turn and a cap of 958, a real client's
connection was closed under a flood that reopened 1,000 connections a second."""

ACCEPT_TURNS = 3
"""Turns of the event loop from an accept to the release of the descriptor of the
connection it pushes out over the cap (the new connection's task, its protocol, then the
close): under a flood, up to this many turns' accepts are open beyond the cap. Measured:
8,000 half heads on 127.0.0.1 against a cap of 3,006 peaked at 750-3,080 descriptors over
it with 1,024 accepts a turn, 775 with 256."""

UNLIMITED_FILES = 1 << 20
"""What an unlimited open-files limit counts as: Linux's own ceiling (``fs.nr_open``)."""

OWN_FILES = 64
"""Descriptors the proxy's process holds besides its connections: the listening socket,
the event loop's, standard streams, the log's writer, imported extension modules."""

MIN_CLIENTS = 64
"""The fewest client connections the proxy serves, however few descriptors it has: fewer
would refuse ordinary traffic, and the open-files warning at start says why."""

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
    head_timeout: float = DEFAULT_HEAD_TIMEOUT
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    max_clients: int | None = None
    """Client connections at most (past it the quietest are closed); ``None``: as many as
    the open-files limit leaves room for (``client_room``)."""

    def __post_init__(self) -> None:
        counts = ("max_body", "connections_per_instance")
        for name in (*counts, *(() if self.max_clients is None else ("max_clients",))):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise SettingError(name, f"must be a positive whole number, got {value!r}")
        seconds = ("prefill_timeout", "health_interval", "health_timeout")
        for name in (*seconds, "head_timeout", "idle_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise SettingError(name, f"must be a positive number of seconds, got {value!r}")


def files_reserve(upstream: int, instances: int) -> int:
    """Descriptors kept from client connections: the ``upstream`` connections to
    ``instances`` instances (and a health check each), the connections accepted beyond the
    cap before it pushes others out (``ACCEPT_TURNS`` x ``ACCEPTS_PER_TURN``), and the
    process's own (``OWN_FILES``)."""
    return upstream + instances + ACCEPT_TURNS * ACCEPTS_PER_TURN + OWN_FILES


def soft_open_files() -> int:
    """This process's soft open-files limit (``UNLIMITED_FILES`` when unlimited or unknown)."""
    limit = open_files_limit()
    return UNLIMITED_FILES if limit is None else limit


def client_room(open_files: int, upstream: int, instances: int) -> int:
    """The client connections that fit in ``open_files`` descriptors after
    ``files_reserve``; ``MIN_CLIENTS`` at least."""
    return max(MIN_CLIENTS, open_files - files_reserve(upstream, instances))


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
