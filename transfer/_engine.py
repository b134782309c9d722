"""TransferEngine: registered memory, peers, and the threads that serve them.

Contract:

- ``register(buffer, access=)`` -> :class:`Region`; ``unregister`` refuses while in use.
- ``metadata()`` -> bytes a peer passes to ``connect()``; ``connect()`` -> :class:`Peer`.
- ``peer.write(ops, notify=)`` / ``peer.read(ops)`` -> :class:`TransferHandle`.
- Remote ops are checked (region, access key, access mode, bounds) before a byte moves.
- ``notifications()`` returns what peers sent with ``notify=`` after their bytes landed.
- ``close()`` stops and joins every thread the engine started; also a context manager.

Threads, all owned here and joined by ``close()``: the control thread (zmq ROUTER) and
its call pool, the TCP accept thread, one thread per served stream, two per stream of each
peer we connected to, and the watchdog that fails overdue batches. A dial-only engine
(``serve=False``: a cache client) has none of the first three: no listening socket, no
control server; only its streams' threads and the watchdog.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from .._bounded_log import BoundedLog
from .._closing import Closing
from ._address import tcp_endpoint
from ._control import ControlServer, QuickHandler, RequestHandler
from ._control_client import ControlClient
from ._device import is_device
from ._errors import EngineClosed, LocalProtocolError, RemoteProtocolError
from ._handle import TransferHandle
from ._keyring import DEFAULT_PRINCIPAL, Keyring, Principal, check_principal
from ._metadata import EngineInfo
from ._nixl import NixlTransport
from ._nixl_agent import nixl_available
from ._owned_context import OwnedContext
from ._peer import EngineSide, Peer
from ._pipes import Pipe
from ._regions import Guard, Region, RegionTable
from ._served import ServedStreams
from ._sessions import Caller, SessionTable
from ._settings import TransferSettings
from ._streams import ServeHooks
from ._transports import MemoryTransport, TcpDialer, TcpTransport, Transport
from ._ucx import UcxTransport, ucx_available
from ._ucx_builds import claim as claim_ucx
from ._ucx_builds import free_for
from ._watchdog import Watchdog

TRANSPORTS = ("tcp", "ucx", "nixl", "memory")

_log = logging.getLogger("kvbridge.transfer")


@dataclass(frozen=True)
class Notification:
    """A message a peer attached to a write, delivered after all of its bytes landed."""

    peer: str
    message: bytes


class TransferEngine(Closing):
    """Moves bytes between registered regions of engines, over TCP streams or in memory.

    ``host``/``port``: where the control socket listens (127.0.0.1 and a free port by
    default; the TCP data listener uses the same host and ``data_port``). ``transports``:
    ``"tcp"``, ``"ucx"`` (ucxx: shared memory on one host, TCP or RDMA between hosts),
    ``"memory"`` (peers in this process), ``"nixl"`` (one-sided, trusted peers only),
    several in order of preference, or ``"auto"`` (``ucx`` then ``tcp`` where ucxx imports,
    else ``tcp``; a dialing engine where NIXL imports and ucxx does not: ``nixl`` then
    ``tcp``); a peer gets the first one it
    also offers (``peer.transport``). ``secret``: a
    shared secret (bytes or str); engines then authenticate each other and refuse peers
    that do not know it. ``principal``: who this engine speaks for when it connects
    (``secret`` is then that principal's secret; see ``_keyring``). ``principals``: whom it
    answers, each with a secret of its own, instead of the one ``secret`` (a cache server's
    tenants); the principal a peer proved is ``Caller.principal``. ``clock`` times frame
    deadlines, the keepalive's silence, batch deadlines and idle sessions (tests pass a fake
    one and advance it; sockets still wait in real seconds). ``serve``: ``False`` makes an
    engine that only dials (a cache client): no control socket, no data listener, nothing
    a peer can reach; :meth:`address`, :meth:`metadata` and the handlers of what it would
    serve raise :class:`LocalProtocolError`. ``settings``: see :class:`TransferSettings`.
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        transports: Sequence[str] | str = ("tcp",),
        secret: bytes | str | None = None,
        principal: str = DEFAULT_PRINCIPAL,
        principals: Sequence[Principal] | None = None,
        clock: Callable[[], float] = time.monotonic,
        serve: bool = True,
        **settings: Any,
    ) -> None:
        self.settings = TransferSettings.from_kwargs(settings)
        self.serves = serve
        self._clock = clock
        chosen = _chosen(transports, serve=serve)
        self.name = name or f"kvbridge-{secrets.token_hex(4)}"
        self._secret = secret.encode() if isinstance(secret, str) else secret
        self.principal = check_principal(principal)
        self._keyring = Keyring(principals) if principals else Keyring.shared(self._secret)
        self._refusals = BoundedLog(_log)
        self._regions = RegionTable()
        self._sessions = SessionTable(clock=clock)
        self._lock = threading.Lock()
        self._closed = False
        self._peers: list[Peer] = []
        self._inbox: deque[Notification] = deque()
        self._notify_handler: Callable[[Caller, bytes], None] | None = None
        self._session_end_handler: Callable[[Caller], None] | None = None
        self._sessions.on_end = self._session_ended
        self._inbox_cond = threading.Condition()
        self._counters = {
            "bytes_written": 0,
            "bytes_read": 0,
            "batches": 0,
            "batches_failed": 0,
            "served_bytes_in": 0,
            "served_bytes_out": 0,
        }
        self._context: zmq.Context[Any] = OwnedContext()
        self._watchdog = Watchdog(clock)
        self._served = ServedStreams(self.name, self._regions, self._serve_hooks)
        self._side = EngineSide(
            name=self.name,
            settings=self.settings,
            secret=self._secret,
            principal=self.principal,
            context=self._context,
            regions=self._regions,
            watchdog=self._watchdog,
            check_open=self._check_open,
            settled=self._settled,
        )
        self._transports: dict[str, Transport | NixlTransport] = {}
        self._control: ControlServer | None = None
        try:
            for transport in chosen:
                self._transports[transport] = self._start_transport(transport, host)
            if serve:
                self._control = ControlServer(
                    self._context,
                    f"tcp://{host}:{port or '*'}",
                    keyring=self._keyring,
                    metadata=self.metadata,
                    sessions=self._sessions,
                    refusals=self._refusals,
                )
                if self._nixl is not None:
                    self._control.link = self._accept_link
        except BaseException:
            self._shutdown()
            raise

    @property
    def _nixl(self) -> NixlTransport | None:
        nixl = self._transports.get("nixl")
        return nixl if isinstance(nixl, NixlTransport) else None

    def _start_transport(self, transport: str, host: str) -> Transport | NixlTransport:
        """One transport, listening on ``host`` (only dialling, where this engine does not
        serve)."""
        if transport == "nixl":
            if not nixl_available():
                raise LocalProtocolError(
                    "the nixl transport needs NIXL: pip install --no-deps nixl-cu12"
                )
            claim_ucx("nixl")
            return NixlTransport(
                self.name, on_notify=self._notify, session_alive=self.session_alive
            )
        accept = self._served.accept if self.serves else None
        if transport == "tcp":
            if accept is None:
                return TcpDialer(socket_buffer=self.settings.socket_buffer)
            return TcpTransport(
                host,
                self.settings.data_port,
                accept,
                socket_buffer=self.settings.socket_buffer,
                silent_timeout=self.settings.connect_timeout,
            )
        if transport == "ucx":
            if not ucx_available():
                raise LocalProtocolError("the ucx transport needs ucxx: pip install kvbridge[ucx]")
            claim_ucx("ucx")
            return UcxTransport(accept)
        return MemoryTransport(accept)

    # -- regions and metadata ----------------------------------------------------------

    def register(self, buffer: Any, *, access: str = "rw", guard: Guard | None = None) -> Region:
        """Register a buffer (numpy, memoryview, bytearray, mmap...) for remote access.

        ``access`` is what peers may do: ``"r"``, ``"w"``, ``"rw"``, or ``"none"`` for a
        buffer that only this engine's own batches read or fill (the safe choice for a
        client's buffers). Keep the buffer alive and unchanged in size until
        :meth:`unregister`. GPU memory (a cupy array, or anything with
        ``__cuda_array_interface__``) needs the ``ucx`` transport and moves only to peers
        reached over it. ``guard(caller, access, offsets, lengths)``, if given, is asked about
        every remote op that passed the key and bounds checks, with the authenticated
        session that sent it, and returns an :class:`Admission` (a cache server lets a
        session write only into slots it staged, and holds them until the bytes landed);
        serving threads call it concurrently, so it must be thread-safe.
        """
        self._check_open()
        if is_device(buffer) and not {"ucx", "nixl"} & set(self._transports):
            raise LocalProtocolError("GPU memory moves over the ucx and nixl transports only")
        region = self._regions.register(buffer, access, guard)
        if self._nixl is not None:
            try:
                self._nixl.register(region)
            except BaseException:
                self._regions.unregister(region)
                raise
        return region

    def set_notify_handler(self, handler: Callable[[Caller, bytes], None] | None) -> None:
        """Take notifications with ``handler(caller, message)`` instead of queueing them
        for :meth:`notifications`. It runs on the stream's serve thread after the batch's
        bytes landed, before the writer's batch is done; raising :class:`NotifyRefused`
        fails the writer's batch with its message (a cache server commits puts this way)."""
        self._notify_handler = handler

    def set_request_handler(
        self, handler: RequestHandler | None, quick: QuickHandler | None = None
    ) -> None:
        """Answer peers' :meth:`Peer.call` requests with ``handler(caller, body)``, which
        returns the reply body (a map of msgpack types). ``caller.session`` identifies the
        authenticated session (unique, never reused). Calls run on a pool of threads, each
        session's in the order they came, sessions side by side; an exception the handler
        raises is logged and answered as an internal error. ``quick(caller, body)``, if
        given, is tried first on the control thread itself when the session has nothing
        queued: it answers at once, or returns ``None`` to leave the call to ``handler`` on
        the pool (it must never wait: one thread answers every session through it)."""
        control = self._serving("answer calls")
        control.handler = handler
        control.quick = quick

    def session_alive(self, caller: Caller) -> bool:
        """Whether ``caller``'s session is still open (see :meth:`set_session_end_handler`)."""
        return self._sessions.alive(caller)

    def set_session_end_handler(self, handler: Callable[[Caller], None] | None) -> None:
        """Call ``handler(caller)`` when a peer's session ends: its last data stream closed,
        it said goodbye, or it sat idle without streams (see ``_sessions``). An application
        releases there what the session held. Runs on whichever engine thread saw the end."""
        self._session_end_handler = handler

    def unregister(self, region: Region) -> None:
        """Forget a region; raises :class:`RegionBusy` while a transfer uses it. A ``nixl``
        peer that still writes into it afterwards is not stopped by the target (see
        ``_nixl``): unregister only what no linked peer uses."""
        self._regions.unregister(region)
        if self._nixl is not None:
            self._nixl.unregister(region)

    def host_view(self, region_id: int) -> memoryview | None:
        """The bytes of a registered region in host memory (to checksum what it sends or
        received), or ``None`` for GPU memory; raises ``LocalProtocolError`` for an id not
        registered here."""
        region = self._regions.get(region_id)
        return None if region.device else region.view

    @property
    def address(self) -> str:
        """``host:port`` of the control socket: what :meth:`dial` takes."""
        return self._serving("have an address").endpoint.removeprefix("tcp://")

    def metadata(self) -> bytes:
        """What a peer needs to reach this engine and its regions (msgpack, versioned)."""
        info = EngineInfo(
            name=self.name,
            control=self._serving("have metadata").endpoint,
            transports={name: t.address() for name, t in self._transports.items()},
            regions={r.id: r for r in self._regions.infos()},
        )
        return info.encode()

    # -- peers -------------------------------------------------------------------------

    def dial(self, address: str) -> Peer:
        """Connect to the engine whose control socket listens at ``address``
        (``host:port``, IPv6 as ``[::1]:port``, or either behind ``tcp://``): :meth:`connect`
        without carrying its metadata out of band. Raises :class:`BadAddress` (a
        :class:`LocalProtocolError`) for anything else, before a socket exists."""

        self._check_open()
        endpoint = tcp_endpoint(address)
        client = ControlClient(self._context, endpoint, self.settings.connect_timeout)
        try:
            credentials, metadata = client.handshake(self.name, self._secret, self.principal)
            client.bye(credentials)  # connect() opens a session of its own
        finally:
            client.close()
        return self.connect(metadata)

    def connect(self, metadata: bytes) -> Peer:
        """Authenticate with the engine ``metadata`` describes and open data streams to it.

        Uses the first of this engine's transports that the peer offers.
        """
        self._check_open()
        info = EngineInfo.decode(metadata)
        transport = next(
            (t for name, t in self._transports.items() if name in info.transports), None
        )
        if transport is None:
            raise LocalProtocolError(
                f"no common transport: we have {list(self._transports)}, "
                f"{info.name} offers {list(info.transports)}"
            )
        peer = Peer(self._side, info, transport)
        with self._lock:
            self._peers.append(peer)
        return peer

    def notifications(self, timeout: float | None = 0.0) -> list[Notification]:
        """Take the notifications received so far; wait up to ``timeout`` s for a first one
        (``None``: wait until one arrives)."""
        with self._inbox_cond:
            self._inbox_cond.wait_for(lambda: self._inbox or self._closed, timeout)
            taken = list(self._inbox)
            self._inbox.clear()
            return taken

    def stats(self) -> dict[str, Any]:
        """Counters, each peer with its transport, the data streams this engine serves
        (``served_streams``), the calls its request handler has queued or running
        (``calls_queued``) and the frame and batch deadlines armed (``deadlines``)."""
        with self._lock:
            counters = dict(self._counters)
            peers = [
                {"name": p.name, "transport": p.transport, "closed": p.closed} for p in self._peers
            ]
        refused = self._refusals.counts()
        return {
            **counters,
            "refused": refused,
            "transports": list(self._transports),
            "peers": peers,
            "served_streams": len(self._served),
            "calls_queued": self._control.calls_queued() if self._control is not None else 0,
            "deadlines": self._watchdog.armed(),
        }

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Close peers and served streams, stop every thread and join it. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with self._inbox_cond:
            self._inbox_cond.notify_all()
        self._shutdown()

    def _shutdown(self) -> None:
        with self._lock:
            peers, self._peers = self._peers, []
        for peer in peers:
            peer.close("the engine is closing")
        if self._control is not None:
            self._control.close()
        for transport in self._transports.values():
            transport.close()
        self._served.close()
        self._session_end_handler = None
        self._watchdog.close()
        self._context.term()

    # -- internals ---------------------------------------------------------------------

    def _serving(self, what: str) -> ControlServer:
        if self._control is None:
            raise LocalProtocolError(f"engine {self.name} only dials: it cannot {what}")
        return self._control

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed(f"engine {self.name} is closed")

    def _serve_hooks(self, greeted: Callable[[Pipe], None]) -> ServeHooks:
        return ServeHooks(
            sessions=self._sessions,
            on_notify=self._notify,
            on_bytes=self._count_served,
            handshake_timeout=self.settings.connect_timeout,
            frame_timeout=self.settings.timeout,
            watch=self._watchdog.watch_until,
            greeted=greeted,
            refusals=self._refusals,
            keepalive=self.settings.keepalive,
            clock=self._clock,
        )

    def _session_ended(self, caller: Caller) -> None:
        if self._nixl is not None:
            self._nixl.session_ended(caller)
        handler = self._session_end_handler
        if handler is not None:
            handler(caller)

    def _accept_link(self, caller: Caller, body: dict[str, Any]) -> dict[str, Any]:
        """A session's ``link`` request: the ``nixl`` agents meet (see ``_nixl``)."""
        assert self._nixl is not None
        wanted = body.get("regions")
        if not isinstance(wanted, list):
            raise RemoteProtocolError("a link request names the regions it wants")
        offered = {info.id for info in self._regions.infos()}
        return self._nixl.accept_link(caller, body, [i for i in wanted if i in offered])

    def _notify(self, caller: Caller, message: bytes) -> None:
        handler = self._notify_handler
        if handler is None:
            self._deliver(caller.peer, message)
        else:
            handler(caller, message)

    def _deliver(self, peer: str, message: bytes) -> None:
        with self._inbox_cond:
            self._inbox.append(Notification(peer, message))
            self._inbox_cond.notify_all()

    def _count_served(self, received: int, sent: int) -> None:
        with self._lock:
            self._counters["served_bytes_in"] += received
            self._counters["served_bytes_out"] += sent

    def _settled(self, handle: TransferHandle, access: str, regions: list[Region]) -> None:
        """Runs before the handle reports done: the regions are free once ``wait()`` returns."""
        self._regions.release(regions)
        with self._lock:
            self._counters["batches"] += 1
            if handle.error is not None:
                self._counters["batches_failed"] += 1
            elif access == "w":
                self._counters["bytes_written"] += handle.bytes
            else:
                self._counters["bytes_read"] += handle.bytes


def _auto(*, serve: bool) -> tuple[str, ...]:
    """``"auto"``: ucx where ucxx imports, then tcp. An engine that only dials (a cache
    client) where NIXL imports and ucxx does not takes nixl first instead (one-sided, to a
    server that offers it; ucxx's UCX and NIXL's do not share a process, so where both are
    installed ``auto`` keeps ucx, and nixl is asked for by name). An engine that serves
    never takes nixl unasked: a one-sided peer reaches any byte it registered."""
    if not serve and nixl_available() and not ucx_available() and free_for("nixl"):
        return ("nixl", "tcp")
    return ("ucx", "tcp") if ucx_available() and free_for("ucx") else ("tcp",)


def _chosen(transports: Sequence[str] | str, *, serve: bool) -> list[str]:
    """The transports asked for, in order; ``"auto"``: see :func:`_auto`."""
    if transports == "auto" or list(transports) == ["auto"]:
        transports = _auto(serve=serve)
    elif isinstance(transports, str):
        transports = (transports,)
    chosen = list(transports)
    unknown = [t for t in chosen if t not in TRANSPORTS]
    if unknown or not chosen:
        raise LocalProtocolError(f"transports must be among {TRANSPORTS}, got {chosen}")
    return chosen
