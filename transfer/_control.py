"""The control plane: handshake, authentication and metadata over pyzmq + msgpack.

Each engine binds a ROUTER socket; a connecting engine talks to it with a short-lived
DEALER. Messages are msgpack maps (never pickle) and every field is checked.

Handshake (two round trips)::

    initiator -> {op: hello, v, name, nonce: Na}
    responder <- {ok, nonce: Nb, proof: HMAC(secret, "responder" Na Nb) or b"", secured}
    initiator -> {op: auth, nonce: Nb, proof: HMAC(secret, "initiator" Nb Na) or b""}
    responder <- {ok, token, metadata}

Each side proves that it knows the shared secret without sending it; an engine with a
secret refuses a peer without one, either way round. The token then admits the peer's data
streams (their HELLO frame), its later metadata requests, and its ``call`` requests: an
application's own request/reply messages (a msgpack map each way), answered by the handler
the engine was given (a cache server's store operations ride on this).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from ._errors import AuthenticationError, PeerClosed, RemoteProtocolError
from ._protocol import TOKEN_BYTES

CONTROL_VERSION = 1
MAX_CONTROL_MESSAGE = 1 << 20
"""Control messages are small maps; metadata of thousands of regions fits in 1 MiB."""
MAX_SESSIONS = 4096
"""Sessions kept per engine; the oldest is forgotten first (its streams stay up)."""
MAX_CHALLENGES = 1024
"""Handshakes half done at once; the oldest is dropped first."""


RequestHandler = Callable[[str, dict[str, Any]], dict[str, Any]]
"""``handler(peer_name, body) -> reply body`` for ``call`` requests."""


def _proof(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, b"kvbridge-" + role + first + second, hashlib.sha256).digest()


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
        secret: bytes | None,
        metadata: Callable[[], bytes],
        name: str,
    ) -> None:
        self.handler: RequestHandler | None = None
        self._secret = secret
        self._metadata = metadata
        self._name = name
        self._socket = context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE)
        self._socket.bind(endpoint)
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._waker_address = f"inproc://kvbridge-control-{secrets.token_hex(8)}"
        self._wake_rx = context.socket(zmq.PAIR)
        self._wake_rx.bind(self._waker_address)
        self._wake_tx = context.socket(zmq.PAIR)
        self._wake_tx.connect(self._waker_address)
        self._sessions: OrderedDict[bytes, str] = OrderedDict()
        self._challenges: OrderedDict[bytes, tuple[bytes, str]] = OrderedDict()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvbridge-control", daemon=True)
        self._thread.start()

    def session(self, token: bytes) -> str | None:
        """The peer name a session token belongs to, or ``None``."""
        with self._lock:
            return self._sessions.get(token)

    def close(self) -> None:
        self._wake_tx.send(b"stop")
        self._thread.join()
        self._wake_tx.close()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._wake_rx in ready:
                    return
                frames = self._socket.recv_multipart()
                if len(frames) != 3 or frames[1] != b"":
                    continue  # not a DEALER request envelope: drop it
                identity, _, body = frames
                rid = None
                try:
                    message = unpack(body)
                    rid = message.get("rid")
                    answer = self._answer(message)
                except Exception as exc:  # any bad request gets an answer; the loop goes on
                    answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                if isinstance(rid, int):
                    answer["rid"] = rid  # lets a client tell this answer from a late one
                try:
                    reply = pack(answer)
                except Exception as exc:
                    reply = pack({"ok": False, "error": f"unpackable answer: {exc}", "rid": rid})
                self._socket.send_multipart([identity, b"", reply])
        finally:
            self._socket.close()
            self._wake_rx.close()

    def _answer(self, message: dict[str, Any]) -> dict[str, Any]:
        op = message.get("op")
        if op == "hello":
            if message["v"] != CONTROL_VERSION:
                raise RemoteProtocolError(f"control version {message['v']} is not supported")
            their_nonce = _bytes(message["nonce"], 16)
            peer = str(message["name"])[:256]
            nonce = secrets.token_bytes(16)
            proof = b""
            if self._secret is not None:
                proof = _proof(self._secret, b"responder", their_nonce, nonce)
                expected = _proof(self._secret, b"initiator", nonce, their_nonce)
            else:
                expected = b""
            with self._lock:
                self._challenges[nonce] = (expected, peer)
                while len(self._challenges) > MAX_CHALLENGES:
                    self._challenges.popitem(last=False)
            return {"ok": True, "nonce": nonce, "proof": proof, "secured": self._secret is not None}
        if op == "auth":
            nonce = _bytes(message["nonce"], 16)
            with self._lock:
                challenge = self._challenges.pop(nonce, None)
            if challenge is None:
                raise AuthenticationError("unknown or expired handshake")
            expected, peer = challenge
            if not hmac.compare_digest(expected, _bytes(message["proof"], len(expected))):
                raise AuthenticationError("wrong shared secret")
            token = secrets.token_bytes(TOKEN_BYTES)
            with self._lock:
                self._sessions[token] = peer
                while len(self._sessions) > MAX_SESSIONS:
                    self._sessions.popitem(last=False)
            return {"ok": True, "token": token, "metadata": self._metadata()}
        if op == "metadata":
            if self.session(_bytes(message["token"], TOKEN_BYTES)) is None:
                raise AuthenticationError("unknown session token")
            return {"ok": True, "metadata": self._metadata()}
        if op == "call":
            caller = self.session(_bytes(message["token"], TOKEN_BYTES))
            if caller is None:
                raise AuthenticationError("unknown session token")
            body = message["body"]
            if self.handler is None or not isinstance(body, dict):
                raise RemoteProtocolError("this engine answers no calls")
            return {"ok": True, "body": self.handler(caller, body)}
        raise RemoteProtocolError(f"unknown control op {op!r}")


def _bytes(value: Any, size: int) -> bytes:
    if not isinstance(value, bytes) or len(value) != size:
        raise RemoteProtocolError(f"expected {size} bytes")
    return value


class ControlClient:
    """A short-lived DEALER to one engine's control socket."""

    def __init__(self, context: zmq.Context[Any], endpoint: str, timeout: float) -> None:
        self._socket = context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE)
        self._socket.connect(endpoint)
        self._endpoint = endpoint
        self._timeout = timeout
        self._rids = itertools.count(1)

    def send(self, message: dict[str, Any]) -> None:
        """Send without waiting: the answer is skipped by the next :meth:`request`."""
        self._socket.send_multipart([b"", pack({**message, "rid": next(self._rids)})])

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        rid = next(self._rids)
        self._socket.send_multipart([b"", pack({**message, "rid": rid})])
        deadline = time.monotonic() + self._timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._socket.poll(int(left * 1000) + 1):
                raise PeerClosed(f"no answer from {self._endpoint} within {self._timeout} s")
            frames = self._socket.recv_multipart()
            if len(frames) != 2 or frames[0] != b"":
                continue
            reply = unpack(frames[1])
            if reply.get("rid") == rid:
                break  # earlier answers (to sends, or to timed-out requests) are skipped
        if not reply.get("ok"):
            error = str(reply.get("error", "refused"))
            if error.startswith("AuthenticationError"):
                raise AuthenticationError(f"{self._endpoint}: {error}")
            raise RemoteProtocolError(f"{self._endpoint}: {error}")
        return reply

    def handshake(self, name: str, secret: bytes | None) -> tuple[bytes, bytes]:
        """Authenticate; return the session token and the peer's current metadata."""
        nonce = secrets.token_bytes(16)
        reply = self.request({"op": "hello", "v": CONTROL_VERSION, "name": name, "nonce": nonce})
        their_nonce = _bytes(reply.get("nonce"), 16)
        proof = b""
        if secret is not None:
            if not reply.get("secured"):
                raise AuthenticationError(f"{self._endpoint} has no shared secret")
            expected = _proof(secret, b"responder", nonce, their_nonce)
            if not hmac.compare_digest(expected, _bytes(reply.get("proof"), len(expected))):
                raise AuthenticationError(f"{self._endpoint} does not know the shared secret")
            proof = _proof(secret, b"initiator", their_nonce, nonce)
        elif reply.get("secured"):
            raise AuthenticationError(f"{self._endpoint} requires a shared secret")
        reply = self.request({"op": "auth", "nonce": their_nonce, "proof": proof})
        return _bytes(reply.get("token"), TOKEN_BYTES), bytes(reply["metadata"])

    def metadata(self, token: bytes) -> bytes:
        return bytes(self.request({"op": "metadata", "token": token})["metadata"])

    def cast(self, token: bytes, body: dict[str, Any]) -> None:
        """A call whose answer nobody waits for."""
        self.send({"op": "call", "token": token, "body": body})

    def call(self, token: bytes, body: dict[str, Any]) -> dict[str, Any]:
        reply = self.request({"op": "call", "token": token, "body": body}).get("body")
        if not isinstance(reply, dict):
            raise RemoteProtocolError(f"{self._endpoint}: a call reply must be a map")
        return reply

    def close(self) -> None:
        self._socket.close()
