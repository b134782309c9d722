"""The proxy's client connections: each in one ledger with what the proxy waits on it for,
a deadline for that wait, and a cap on how many there are.

A connection is in one phase at a time; the proxy waits on the client in three of them,
and each of those has a deadline (the flags are ``kvbridge proxy``'s):

- ``head``: a request head, from the accept or from the first byte after an idle spell;
  closed when the head is not whole ``--head-timeout`` s after it began, however slowly
  its bytes trickle in;
- ``body``: the rest of a request body; closed when no byte came for ``--head-timeout`` s;
- ``idle``: the next request on a keep-alive connection; closed after ``--idle-timeout`` s;
- ``answer``: nothing: the proxy answers (the upstreams take their time); no deadline.

Past ``cap`` connections, each new one closes the waiting connection (head, body or idle)
silent the longest, or itself when no other waits: a connection being answered is never
closed for the cap. A stranger who opens connections and sends half a head (or nothing)
so holds each for ``--head-timeout`` s at most, and a flood of them pushes out only each
other and idle connections, never the descriptors the proxy needs to answer.

How the ledger hears: ``GuardedSite`` serves aiohttp's protocol for each accepted
connection wrapped (``_Watched``), which tells the ledger of each byte heard and of the
connection's end; the app tells it when a request's head is whole (``started``), when its
body is read (``answering``) and when its answer is done (``ended``). Connections it did
not wrap (aiohttp's test server's) are not in it, and these calls do nothing for them.
Closes are counted by reason (``closed``) and logged as warnings, which the proxy's log
bounds (``_proxy_log``). One owner, the app, on its event loop: ``close`` cancels every
timer.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import socket
from collections import Counter, OrderedDict
from dataclasses import dataclass

from aiohttp import web

_log = logging.getLogger("kvbridge.proxy")


class Phase(enum.Enum):
    HEAD = "head"
    BODY = "body"
    ANSWER = "answer"
    IDLE = "idle"


CLOSE_REASONS = {
    Phase.HEAD: "head_timeout",
    Phase.BODY: "body_timeout",
    Phase.IDLE: "idle_timeout",
}
"""Why a connection past its phase's deadline is closed (the ``closed`` counter's keys,
with ``over_cap``)."""

_WAITS_FOR = {
    Phase.HEAD: "a request head",
    Phase.BODY: "a request body",
    Phase.IDLE: "a next request",
    Phase.ANSWER: "nothing",
}


@dataclass(eq=False)
class _Client:
    """One connection in the ledger; ``since``: when its phase's wait began; ``heard``: its
    last byte; ``early``: a next request's bytes came while this one was answered."""

    transport: asyncio.BaseTransport
    phase: Phase
    since: float
    heard: float
    early: bool = False
    gone: bool = False
    timer: asyncio.TimerHandle | None = None


class ClientConnections:
    """The ledger (see the module's docstring); ``len()`` is how many connections are open."""

    def __init__(self, cap: int, head_timeout: float, idle_timeout: float) -> None:
        self.cap = cap
        self.closed: Counter[str] = Counter()
        self._head = head_timeout
        self._idle = idle_timeout
        self._clients: dict[asyncio.BaseTransport, _Client] = {}
        self._quiet: OrderedDict[_Client, None] = OrderedDict()
        """The connections waited on, the one silent the longest first."""

    def __len__(self) -> int:
        return len(self._clients)

    def watch(self, protocol: asyncio.Protocol) -> asyncio.Protocol:
        """``protocol`` (aiohttp's, for a connection just accepted), reporting to the ledger."""
        return _Watched(protocol, self)

    def close(self) -> None:
        """Forget every connection and cancel its timer (the server closes the connections)."""
        for client in list(self._clients.values()):
            self._forget(client)

    # -- what the app tells -----------------------------------------------------------------

    def started(self, transport: asyncio.BaseTransport | None, *, body: bool) -> None:
        """A request's head is whole; ``body``: the request has a body still to read."""
        client = self._client(transport)
        if client is None:
            return
        client.early = False
        if not body:
            self._answer(client)
            return
        client.phase = Phase.BODY
        self._arm(client)

    def answering(self, transport: asyncio.BaseTransport | None) -> None:
        """The request's body is read: the client waits on the proxy now."""
        client = self._client(transport)
        if client is not None:
            self._answer(client)

    def ended(self, transport: asyncio.BaseTransport | None) -> None:
        """The request is answered: the connection waits for the next one (a head already
        begun, or an idle spell)."""
        client = self._client(transport)
        if client is None:
            return
        client.phase = Phase.HEAD if client.early else Phase.IDLE
        client.since, client.early = _now(), False
        self._quiet[client] = None
        self._quiet.move_to_end(client)
        self._arm(client)

    # -- what a connection's protocol tells -------------------------------------------------

    def opened(self, transport: asyncio.BaseTransport) -> _Client:
        """A connection was accepted: it waits for a head. Past the cap, the connections
        silent the longest are closed (this one when no other waits)."""
        now = _now()
        client = _Client(transport, Phase.HEAD, now, now)
        self._clients[transport] = client
        self._quiet[client] = None
        self._arm(client)
        while len(self._clients) > self.cap and self._quiet:
            self._close(next(iter(self._quiet)), "over_cap")
        return client

    def heard(self, client: _Client) -> None:
        """Bytes came from ``client``."""
        if client.gone:
            return
        client.heard = _now()
        if client.phase is Phase.ANSWER:
            client.early = True
            return
        if client.phase is Phase.IDLE:
            client.phase, client.since = Phase.HEAD, client.heard
            self._arm(client)
        self._quiet.move_to_end(client)

    def lost(self, client: _Client) -> None:
        """The connection is closed (by either end)."""
        if not client.gone:
            self._forget(client)

    # -- internals --------------------------------------------------------------------------

    def _client(self, transport: asyncio.BaseTransport | None) -> _Client | None:
        return None if transport is None else self._clients.get(transport)

    def _answer(self, client: _Client) -> None:
        client.phase = Phase.ANSWER
        self._quiet.pop(client, None)
        self._arm(client)

    def _deadline(self, client: _Client) -> float | None:
        if client.phase is Phase.HEAD:
            return client.since + self._head
        if client.phase is Phase.BODY:
            return client.heard + self._head
        if client.phase is Phase.IDLE:
            return client.since + self._idle
        return None

    def _arm(self, client: _Client) -> None:
        """Set ``client``'s timer to its phase's deadline (none while it is answered). Bytes
        heard in ``body`` move the deadline later without a new timer: ``_expire`` looks
        again when it fires."""
        if client.timer is not None:
            client.timer.cancel()
            client.timer = None
        deadline = self._deadline(client)
        if deadline is not None:
            loop = asyncio.get_running_loop()
            client.timer = loop.call_at(deadline, self._expire, client)

    def _expire(self, client: _Client) -> None:
        client.timer = None
        deadline = self._deadline(client)
        if client.gone or deadline is None:
            return
        if _now() < deadline:
            self._arm(client)
            return
        self._close(client, CLOSE_REASONS[client.phase])

    def _close(self, client: _Client, reason: str) -> None:
        phase = client.phase
        self._forget(client)
        self.closed[reason] += 1
        client.transport.close()
        if reason == "over_cap":
            _log.warning(
                "client connection closed: past the cap of %d (--max-client-connections), "
                "the one silent the longest (it waited for %s)",
                self.cap,
                _WAITS_FOR[phase],
            )
        elif reason == "head_timeout":
            _log.warning(
                "client connection closed: no whole request head within %s s (--head-timeout)",
                self._head,
            )
        elif reason == "body_timeout":
            _log.warning(
                "client connection closed: its request body stopped for %s s (--head-timeout)",
                self._head,
            )
        else:
            _log.debug("idle client connection closed after %s s (--idle-timeout)", self._idle)

    def _forget(self, client: _Client) -> None:
        client.gone = True
        if client.timer is not None:
            client.timer.cancel()
            client.timer = None
        self._clients.pop(client.transport, None)
        self._quiet.pop(client, None)


class _Watched(asyncio.Protocol):
    """aiohttp's protocol for one client connection, telling the ledger what it hears."""

    def __init__(self, inner: asyncio.Protocol, ledger: ClientConnections) -> None:
        self._inner = inner
        self._ledger = ledger
        self._client: _Client | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)
        self._client = self._ledger.opened(transport)

    def data_received(self, data: bytes) -> None:
        if self._client is not None:
            self._ledger.heard(self._client)
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._client is not None:
            self._ledger.lost(self._client)
        self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class GuardedSite(web.BaseSite):
    """aiohttp's ``SockSite``, each connection watched by ``clients``. asyncio accepts as
    many connections in one turn of its loop as the backlog it listens with (``SockSite``'s
    128 by default, whatever the socket had): the site listens with ``accepts_per_turn``,
    then sets the kernel's queue to ``backlog``."""

    def __init__(
        self,
        runner: web.BaseRunner,
        sock: socket.socket,
        clients: ClientConnections,
        *,
        accepts_per_turn: int,
        backlog: int,
    ) -> None:
        super().__init__(runner, backlog=accepts_per_turn)
        self._queue = backlog
        self._sock = sock
        self._clients = clients
        host, port = sock.getsockname()[:2]
        self._name = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    @property
    def name(self) -> str:
        return self._name

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        if server is None:
            raise RuntimeError("the runner is not set up")
        clients = self._clients
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: clients.watch(server()), sock=self._sock, backlog=self._backlog
        )
        self._sock.listen(self._queue)


def _now() -> float:
    return asyncio.get_running_loop().time()
