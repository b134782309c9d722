"""The control plane: handshake, sessions and requests over pyzmq + msgpack.

Each engine binds a ROUTER socket; a connecting engine talks to it with a DEALER. Messages
are msgpack maps (never pickle) and every field is checked.

Handshake (two round trips), for principal ``P`` (see ``_keyring``; ``""`` by default)::

    initiator -> {op: hello, v, name, principal: P, nonce: Na}
    responder <- {ok, nonce: Nb, ticket, secured,
                  proof: HMAC(secret of P, "responder" Na Nb P) or b""}
    initiator -> {op: auth, name, principal: P, nonce: Na, server_nonce: Nb, ticket,
                  proof: HMAC(secret of P, "initiator" Nb Na P) or b""}
    responder <- {ok, session, metadata}

Each side proves that it knows the principal's secret without sending it; an engine with a
secret refuses a peer without one, either way round, and a principal it does not know is
refused as a wrong secret is. The principal is inside every MAC, so it cannot be swapped
in flight. The responder keeps no state between the two round trips: ``ticket`` is its own
MAC over ``Na``, ``Nb``, the name and the principal, valid for :data:`TICKET_TTL_S` and
accepted once, so a flood of unanswered hellos costs it nothing and cannot push out a real
handshake. Refusals are counted and logged at a bounded rate (``kvbridge/_bounded_log``).
Both ends then derive the session key (see ``_sessions``); later requests are signed with
it::

    {op: call | metadata | bye, session, seq, body: bytes, mac}

``call`` carries an application's request (``body`` is a packed msgpack map), answered by
the handler the engine was given (a cache server's store operations ride on it). Refusals
carry a numeric ``code`` (:class:`ControlCode`) as well as a message for people.
"""

from __future__ import annotations

import enum
import hmac
import logging
import secrets
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from .._bounded_log import BoundedLog
from ._calls import CallPool
from ._descriptors import MAX_STRANGERS, trusted_connections
from ._errors import AuthenticationError, LocalProtocolError, RemoteProtocolError
from ._gate import Connection, ConnectionGate
from ._keyring import DEFAULT_PRINCIPAL, Keyring, check_principal
from ._sessions import Caller, SessionsFull, SessionTable, mac, session_key

CONTROL_VERSION = 3
MAX_CONTROL_MESSAGE = 1 << 20
"""Control messages are small maps; metadata of thousands of regions fits in 1 MiB."""
TICKET_TTL_S = 30.0
"""A handshake's second round trip must come within this of its first."""

_SWEEP_S = 1.0
"""How often idle sessions are looked for (each look walks every session)."""

_log = logging.getLogger("kvbridge.transfer")
_STAMP = struct.Struct("<Q")

RequestHandler = Callable[[Caller, dict[str, Any]], dict[str, Any]]
"""``handler(caller, body) -> reply body`` for ``call`` requests."""
QuickHandler = Callable[[Caller, dict[str, Any]], "dict[str, Any] | None"]
"""``quick(caller, body) -> reply body``, or ``None`` to leave the call to the pool."""
LinkHandler = Callable[[Caller, dict[str, Any]], dict[str, Any]]
"""``link(caller, body) -> reply body`` for a session's ``link`` request."""


class ControlCode(enum.IntEnum):
    """Why the control plane refused a request (the ``code`` of a refusal)."""

    PROTOCOL = 1
    AUTHENTICATION = 2
    SESSIONS_FULL = 3
    INTERNAL = 4


def proof_of(secret: bytes, role: bytes, first: bytes, second: bytes, principal: str) -> bytes:
    """A handshake proof (the two nonces are 16 bytes each: the parts cannot run together)."""
    return mac(secret, b"kvbridge-" + role, first, second, principal.encode())


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)  # type: ignore[no-any-return]


def unpack(data: bytes) -> dict[str, Any]:
    """Decode a control message; anything but a small msgpack map is a protocol error."""
    if len(data) > MAX_CONTROL_MESSAGE:
        raise RemoteProtocolError("control message too large")
    try:
        message = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise RemoteProtocolError(f"malformed control message: {exc}") from None
    if not isinstance(message, dict):
        raise RemoteProtocolError("a control message must be a map")
    return message


class ControlServer:
    """The engine's ROUTER socket and the thread that answers it."""

    def __init__(
        self,
        context: zmq.Context[Any],
        endpoint: str,
        *,
        keyring: Keyring,
        metadata: Callable[[], bytes],
        sessions: SessionTable,
        refusals: BoundedLog,
    ) -> None:
        self.handler: RequestHandler | None = None
        self.quick: QuickHandler | None = None
        self.link: LinkHandler | None = None
        """Answers a session's ``link`` request (a one-sided transport's exchange of what
        its peer needs: the ``nixl`` agent's metadata), on this thread."""
        self.sessions = sessions
        self._keyring = keyring
        self._refusals = refusals
        self._metadata = metadata
        self._ticket_key = secrets.token_bytes(32)
        self._used: OrderedDict[bytes, float] = OrderedDict()  # tickets taken, by expiry
        self._links: dict[int, tuple[Connection, bytes]] = {}
        """Connections (by descriptor) that linked a session's one-sided transport, with the
        session: it lives as long as the connection (a link has no data stream to end it)."""
        sockets: list[zmq.Socket[Any]] = []
        try:
            self._socket = context.socket(zmq.ROUTER)
            sockets.append(self._socket)
            self._socket.setsockopt(zmq.LINGER, 0)
            self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE)
            self._gate = ConnectionGate(
                self._socket,
                strangers=MAX_STRANGERS,
                trusted=trusted_connections(),
                name="control",
                refusals=refusals,
                on_gone=self._gone,
            )
            sockets.append(self._gate.monitor)
            self._socket.bind(endpoint)
            self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
            waker = f"inproc://kvbridge-control-{secrets.token_hex(8)}"
            self._wake_rx = context.socket(zmq.PAIR)
            sockets.append(self._wake_rx)
            self._wake_rx.bind(waker)
            self._wake_tx = context.socket(zmq.PAIR)
            sockets.append(self._wake_tx)
            self._wake_tx.connect(waker)
            answers = f"inproc://kvbridge-answers-{secrets.token_hex(8)}"
            self._answers = context.socket(zmq.PULL)
            sockets.append(self._answers)
            self._answers.bind(answers)
        except BaseException:  # an open socket would make Context.term() wait for ever
            for sock in sockets:
                sock.close(linger=0)
            raise
        self._calls = CallPool(context, answers)
        self._thread = threading.Thread(target=self._run, name="kvbridge-control", daemon=True)
        self._thread.start()

    def calls_queued(self) -> int:
        """Application calls queued or running in the call pool."""
        return self._calls.queued()

    def close(self) -> None:
        self._wake_tx.send(b"stop")
        self._thread.join()
        self._wake_tx.close()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._answers, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        poller.register(self._gate.monitor, zmq.POLLIN)
        swept = time.monotonic()
        try:
            while True:
                ready = dict(poller.poll(int(_SWEEP_S * 1000)))
                if self._wake_rx in ready:
                    return
                if time.monotonic() - swept >= _SWEEP_S:  # a walk of every session: not often
                    self.sessions.sweep()
                    swept = time.monotonic()
                if self._answers in ready:  # calls answered by the pool's threads
                    while self._answers.poll(0):
                        self._socket.send_multipart(self._answers.recv_multipart())
                if self._socket in ready:
                    self._serve_one()
                self._gate.events()  # after the requests (who spoke is known); at least 1/s
        finally:
            self._calls.close()  # joined before the sockets they answer through close
            self._gate.close()
            self._socket.close()
            self._wake_rx.close()
            self._answers.close()

    def _serve_one(self) -> None:
        frames = self._socket.recv_multipart(copy=False)
        fd = self._gate.heard(frames[-1])
        if len(frames) != 3 or frames[1].bytes != b"":
            return  # not a DEALER request envelope: drop it
        identity, body = frames[0].bytes, frames[2].bytes
        rid = None
        try:
            message = unpack(body)
            rid = message.get("rid")
            answer, proved = self._answer(message, identity, rid)
            if proved is not None:  # a handshake completed, or a signed request
                self._gate.trust(fd, proved)
            if message.get("op") == "link" and answer is not None and answer.get("ok"):
                held = self._gate.held(fd) if fd >= 0 else None
                if held is not None:
                    self._links[fd] = (held, message["session"])
            if answer is None:
                return  # a call: queued, answered by the pool
        except Exception as exc:  # every bad request gets an answer; the loop goes on
            answer = _refusal(exc, self._refusals)
        self._socket.send_multipart(_frames(identity, rid, answer))

    def _answer(
        self, message: dict[str, Any], identity: bytes, rid: Any
    ) -> tuple[dict[str, Any] | None, str | None]:
        """The answer (``None``: the call pool answers) and the principal the request
        proved it speaks for (``None``: a ``hello`` proves nothing)."""
        op = message.get("op")
        if op == "hello":
            return self._hello(message), None
        if op == "auth":
            answer = self._auth(message)
            return answer, _principal(message.get("principal"))
        if op in ("call", "metadata", "bye", "link"):
            caller = self.sessions.verify_call(
                check_bytes(message.get("session"), 16),
                op,
                _int(message.get("seq")),
                check_blob(message.get("body")),
                check_bytes(message.get("mac"), 32),
            )
            return self._signed(op, message, caller, identity, rid), caller.principal
        raise RemoteProtocolError(f"unknown control op {op!r}")

    def _signed(
        self, op: str, message: dict[str, Any], caller: Caller, identity: bytes, rid: Any
    ) -> dict[str, Any] | None:
        """A verified request of a session: its answer, or ``None`` for the call pool."""
        if op == "metadata":
            return {"ok": True, "metadata": self._metadata()}
        if op == "bye":
            self.sessions.end(message["session"])
            return {"ok": True}
        body = message["body"]
        if op == "link":
            if self.link is None:
                raise RemoteProtocolError("this engine offers no one-sided transport")
            return {"ok": True, "body": self.link(caller, unpack(body))}
        session = message["session"]
        if self.quick is not None and not self._calls.busy(session):
            answer = self._quick(self.quick, caller, body)
            if answer is not None:
                return answer
        self._calls.submit(session, lambda: _frames(identity, rid, self._call(caller, body)))
        return None

    def _gone(self, fd: int) -> None:
        """A connection on ``fd`` closed: the session a link made over it ends (its client
        closed or died). The monitor may report an earlier connection's end after a new one
        took the descriptor: a link whose connection is still there lives on."""
        linked = self._links.get(fd)
        if linked is None or self._gate.held(fd) == linked[0]:
            return
        del self._links[fd]
        self.sessions.end(linked[1])

    def _hello(self, message: dict[str, Any]) -> dict[str, Any]:
        if message.get("v") != CONTROL_VERSION:
            raise RemoteProtocolError(f"control version {message.get('v')!r} is not supported")
        their_nonce = check_bytes(message.get("nonce"), 16)
        name, principal = _name(message.get("name")), _principal(message.get("principal"))
        nonce = _STAMP.pack(int(time.monotonic() * 1000)) + secrets.token_bytes(8)
        ticket = self._ticket(their_nonce, nonce, name, principal)
        proof = b""
        secured = self._keyring.secured
        if secured:
            secret = self._keyring.secret(principal)
            assert secret is not None
            proof = proof_of(secret, b"responder", their_nonce, nonce, principal)
        return {"ok": True, "nonce": nonce, "ticket": ticket, "proof": proof, "secured": secured}

    def _ticket(self, their_nonce: bytes, nonce: bytes, name: str, principal: str) -> bytes:
        who = name.encode() + b"\0" + principal.encode()  # a principal never holds a NUL
        return mac(self._ticket_key, b"ticket", their_nonce, nonce, who)

    def _auth(self, message: dict[str, Any]) -> dict[str, Any]:
        their_nonce = check_bytes(message.get("nonce"), 16)
        nonce = check_bytes(message.get("server_nonce"), 16)
        name, principal = _name(message.get("name")), _principal(message.get("principal"))
        ticket = check_bytes(message.get("ticket"), 32)
        expected_ticket = self._ticket(their_nonce, nonce, name, principal)
        issued = _STAMP.unpack(nonce[:8])[0] / 1000
        now = time.monotonic()
        if (
            not hmac.compare_digest(ticket, expected_ticket)
            or not 0 <= now - issued <= TICKET_TTL_S
        ):
            raise AuthenticationError("unknown or expired handshake")
        self._take_ticket(ticket, issued + TICKET_TTL_S, now)
        secret = self._keyring.secret(principal)
        expected = b""
        if self._keyring.secured:
            assert secret is not None
            expected = proof_of(secret, b"initiator", nonce, their_nonce, principal)
        if not hmac.compare_digest(expected, check_bytes(message.get("proof"), len(expected))):
            raise AuthenticationError("wrong shared secret")
        self._keyring.admit(principal)
        key = session_key(secret, their_nonce, nonce, principal)
        limit, streams = self._keyring.max_sessions(principal), self._keyring.max_streams(principal)
        session = self.sessions.open(key, name, principal, limit, streams)
        _log.debug(
            "control: session %d opened for %r (%s)",
            session.caller.session,
            name,
            principal or "default principal",
        )
        return {"ok": True, "session": session.id, "metadata": self._metadata()}

    def _take_ticket(self, ticket: bytes, expiry: float, now: float) -> None:
        while self._used and next(iter(self._used.values())) < now:
            self._used.popitem(last=False)
        if ticket in self._used:
            raise AuthenticationError("handshake replayed")
        self._used[ticket] = expiry

    def _quick(self, quick: QuickHandler, caller: Caller, packed: bytes) -> dict[str, Any] | None:
        """A call answered on this thread, or ``None`` for the pool (a pool hop is two
        thread wake-ups: ~250 us of a 450 us round trip here)."""
        reply = quick(caller, unpack(packed))
        return None if reply is None else {"ok": True, "body": reply}

    def _call(self, caller: Caller, packed: bytes) -> dict[str, Any]:
        """Run on a pool thread: the handler's answer, or the refusal it raised."""
        try:
            body = unpack(packed)
            if self.handler is None:
                raise RemoteProtocolError("this engine answers no calls")
            return {"ok": True, "body": self.handler(caller, body)}
        except Exception as exc:
            return _refusal(exc, self._refusals)


def _frames(identity: bytes, rid: Any, answer: dict[str, Any]) -> list[bytes]:
    """The ROUTER frames of an answer, tagged with the request's ``rid`` (so that a client
    can tell it from a late answer to an earlier request)."""
    if isinstance(rid, int) and not isinstance(rid, bool):
        answer["rid"] = rid
    try:
        reply = pack(answer)
    except Exception:
        _log.exception("control: an answer could not be packed")
        reply = pack({"ok": False, "code": ControlCode.INTERNAL, "error": "unpackable"})
    return [identity, b"", reply]


def _refusal(exc: Exception, refusals: BoundedLog) -> dict[str, Any]:
    if isinstance(exc, SessionsFull):
        code = ControlCode.SESSIONS_FULL
        refusals.refused("sessions_full", logging.WARNING, "control: %s", exc)
    elif isinstance(exc, AuthenticationError):
        code = ControlCode.AUTHENTICATION
        refusals.refused(
            "authentication", logging.WARNING, "control: authentication refused: %s", exc
        )
    elif isinstance(exc, RemoteProtocolError):
        code = ControlCode.PROTOCOL
        refusals.refused("malformed", logging.INFO, "control: malformed request: %s", exc)
    else:
        code = ControlCode.INTERNAL
        _log.error("control: internal error", exc_info=exc)
    return {"ok": False, "code": int(code), "error": str(exc)}


def check_bytes(value: Any, size: int) -> bytes:
    if not isinstance(value, bytes) or len(value) != size:
        raise RemoteProtocolError(f"expected {size} bytes")
    return value


def check_blob(value: Any) -> bytes:
    if not isinstance(value, bytes):
        raise RemoteProtocolError("expected bytes")
    return value


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 2**63:
        raise RemoteProtocolError("expected a positive integer")
    return value


def _principal(value: Any) -> str:
    """The principal a handshake names (left out: the default principal)."""
    if value is None:
        return DEFAULT_PRINCIPAL
    try:
        return check_principal(value)
    except LocalProtocolError as exc:
        raise RemoteProtocolError(str(exc)) from None


def _name(value: Any) -> str:
    if not isinstance(value, str) or len(value) > 256:
        raise RemoteProtocolError("a peer name is a string of at most 256 characters")
    return value
