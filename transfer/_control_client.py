"""The client end of the control plane: a DEALER to one engine's ROUTER (see ``_control``).

A request waits for its answer, or for its connection to fail, whichever comes first: a
socket monitor reports the TCP connection dropping (a peer killed: its kernel closes the
connection at once) or a connection attempt refused (a peer not running), and the request
fails then with ``PeerClosed`` instead of after the whole timeout. Measured on loopback
(``tests/test_transfer_faults.py``): a call in flight to a SIGKILLed server returned after
10.0 s (the timeout) before the monitor, in milliseconds with it, over TCP and UCX data
transports alike (the control plane is the same TCP connection for both). A peer whose host
vanishes without closing its connections still costs the timeout.
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import time
from collections.abc import Iterator
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from ._control import (
    CONTROL_VERSION,
    MAX_CONTROL_MESSAGE,
    ControlCode,
    check_blob,
    check_bytes,
    pack,
    proof_of,
    unpack,
)
from ._errors import AuthenticationError, PeerClosed, RemoteInternalError, RemoteProtocolError
from ._keyring import DEFAULT_PRINCIPAL
from ._sessions import Credentials, SessionsFull, session_key

_RAISES: dict[int, type[Exception]] = {
    ControlCode.AUTHENTICATION: AuthenticationError,
    ControlCode.SESSIONS_FULL: SessionsFull,
    ControlCode.INTERNAL: RemoteInternalError,
}


_CONNECTION_LOST = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
"""Monitor events that end a request in flight: the connection dropped (its answer, if
any, is lost with it), or an attempt to connect was refused (nobody is listening)."""


class ControlClient:
    """A DEALER to one engine's control socket. A ``zmq.ZMQError`` (the socket closed under
    a call by another thread, the context terminated) never escapes: it is ``PeerClosed``."""

    def __init__(self, context: zmq.Context[Any], endpoint: str, timeout: float) -> None:
        self._endpoint = endpoint
        with self._socket_errors():
            self._socket = context.socket(zmq.DEALER)
        self._monitor: zmq.Socket[Any] | None = None
        try:
            with self._socket_errors():
                self._socket.setsockopt(zmq.LINGER, 0)
                self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE)
                self._monitor = self._socket.get_monitor_socket(_CONNECTION_LOST)
                self._socket.connect(endpoint)
        except BaseException:
            self.close()
            raise
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self.timeout = timeout
        self.lost = False
        """Whether a request failed because its connection dropped or was refused."""
        self._drops = 0  # batches of lost-connection events read so far
        self._drops_seen = 0  # ... of which connection_failed() has reported
        self._rid = 0

    def send(self, message: dict[str, Any]) -> None:
        """Send without waiting: the answer is skipped by the next :meth:`request`."""
        self._rid += 1
        with self._socket_errors():
            self._socket.send_multipart([b"", pack({**message, "rid": self._rid})])

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        self._monitor_events()  # before the send: history, not this request's fate
        self.send(message)
        rid = self._rid
        deadline = time.monotonic() + self.timeout
        while True:
            frames = self._next_answer(deadline)
            if len(frames) != 2 or frames[0] != b"":
                continue
            reply = unpack(frames[1])
            if reply.get("rid") == rid:
                break  # earlier answers (to sends, or to timed-out requests) are skipped
        if not reply.get("ok"):
            code = reply.get("code")
            error = _RAISES.get(code, RemoteProtocolError) if isinstance(code, int) else None
            raise (error or RemoteProtocolError)(f"{self._endpoint}: {reply.get('error')}")
        return reply

    def handshake(
        self, name: str, secret: bytes | None, principal: str = DEFAULT_PRINCIPAL
    ) -> tuple[Credentials, bytes]:
        """Authenticate as ``principal`` (which ``secret`` is the secret of); return the
        session's credentials and the peer's metadata."""
        nonce = secrets.token_bytes(16)
        hello = {"op": "hello", "v": CONTROL_VERSION, "name": name, "nonce": nonce}
        reply = self.request({**hello, "principal": principal})
        their_nonce = check_bytes(reply.get("nonce"), 16)
        proof = b""
        if secret is not None:
            if not reply.get("secured"):
                raise AuthenticationError(f"{self._endpoint} has no shared secret")
            expected = proof_of(secret, b"responder", nonce, their_nonce, principal)
            if not hmac.compare_digest(expected, check_bytes(reply.get("proof"), len(expected))):
                raise AuthenticationError(f"{self._endpoint} does not know the shared secret")
            proof = proof_of(secret, b"initiator", their_nonce, nonce, principal)
        elif reply.get("secured"):
            raise AuthenticationError(f"{self._endpoint} requires a shared secret")
        auth = {
            "op": "auth",
            "name": name,
            "principal": principal,
            "nonce": nonce,
            "server_nonce": their_nonce,
            "ticket": reply.get("ticket"),
            "proof": proof,
        }
        reply = self.request(auth)
        credentials = Credentials(
            check_bytes(reply.get("session"), 16),
            session_key(secret, nonce, their_nonce, principal),
        )
        return credentials, check_blob(reply.get("metadata"))

    def metadata(self, credentials: Credentials) -> bytes:
        return check_blob(self.request(credentials.sign("metadata", b"")).get("metadata"))

    def bye(self, credentials: Credentials) -> None:
        """End the session (its streams, if any, stay up until they close)."""
        with contextlib.suppress(PeerClosed, AuthenticationError):
            self.request(credentials.sign("bye", b""))

    def link(self, credentials: Credentials, body: dict[str, Any]) -> dict[str, Any]:
        """A one-sided transport's exchange with the peer (see ``ControlServer.link``)."""
        reply = self.request(credentials.sign("link", pack(body))).get("body")
        if not isinstance(reply, dict):
            raise RemoteProtocolError(f"{self._endpoint}: a link reply must be a map")
        return reply

    def cast(self, credentials: Credentials, body: dict[str, Any]) -> None:
        """A call whose answer nobody waits for."""
        self.send(credentials.sign("call", pack(body)))

    def call(self, credentials: Credentials, body: dict[str, Any]) -> dict[str, Any]:
        reply = self.request(credentials.sign("call", pack(body))).get("body")
        if not isinstance(reply, dict):
            raise RemoteProtocolError(f"{self._endpoint}: a call reply must be a map")
        return reply

    def close(self) -> None:
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.disable_monitor()
            self._monitor.close(linger=0)
        self._socket.close(linger=0)

    def _next_answer(self, deadline: float) -> list[bytes]:
        """The next message from the peer; ``PeerClosed`` when the deadline passes or the
        connection fails first."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerClosed(f"no answer from {self._endpoint} within {self.timeout} s")
            with self._socket_errors():
                ready = dict(self._poller.poll(int(left * 1000) + 1))
                if self._socket in ready:
                    frames: list[bytes] = self._socket.recv_multipart()
                    return frames
            if self._monitor_events():
                self.lost = True
                raise PeerClosed(f"{self._endpoint}: the connection dropped or was refused")

    def connection_failed(self) -> bool:
        """Whether the connection dropped or was refused since the last time this said so
        (a request that read the event meanwhile included); never waits. The DEALER
        reconnects by itself, so a drop may be over already: the caller decides."""
        self._monitor_events()
        new, self._drops_seen = self._drops != self._drops_seen, self._drops
        return new

    def _monitor_events(self) -> bool:
        """Read the monitor's pending events; whether there were any (each one says the
        connection failed)."""
        failed = False
        assert self._monitor is not None
        with self._socket_errors():
            while self._monitor.poll(0):
                recv_monitor_message(self._monitor)  # only the lost-connection events
                failed = True
        self._drops += failed
        return failed

    @contextlib.contextmanager
    def _socket_errors(self) -> Iterator[None]:
        try:
            yield
        except zmq.ZMQError as exc:
            raise PeerClosed(f"{self._endpoint}: control socket: {exc}") from None
