"""Sessions: what an authenticated handshake grants, and how each later use proves it.

A handshake (see ``_control``) ends with a session: a public id (16 random bytes, sent in
clear) and a session key that both ends derive from the shared secret and the handshake's
two nonces and that never crosses the wire. Every later use of the session carries an HMAC
under that key: a control request MACs its sequence number and body (a sequence number is
accepted once, in increasing order, so a captured request cannot be replayed), a data
stream's HELLO MACs a fresh nonce (each nonce admits one stream). Whoever sees the traffic
learns the id, never the key: without the secret they cannot use the session.

Without a shared secret the key derives from public values: anyone who sees the handshake
can use the session. That mode is for loopback and trusted networks only (the cache server
refuses to listen elsewhere without ``--insecure``).

Lifetime: a session lives while it has a data stream open; one without streams (a control-only
client, or one whose streams all closed) ends once idle for ``idle_s``, or earlier when the
table is full and a new session needs its place. Sessions with open streams are never
evicted: a flood of handshakes cannot log out a working client. When a session ends, the
engine tells the application (``on_end``) so that it can release what the session held.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import secrets
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ._errors import AuthenticationError

SESSION_ID_BYTES = 16
NONCE_BYTES = 16
MAC_BYTES = 32
HELLO_BYTES = SESSION_ID_BYTES + NONCE_BYTES + MAC_BYTES
"""A data stream's HELLO body: session id, fresh nonce, HMAC(session key, nonce, index)."""

MAX_SESSIONS = 4096
"""Sessions kept at once. Only sessions without a stream are ever evicted to make room; when
all have streams, a new handshake is refused (``SessionsFull``) rather than logging anyone out."""

MAX_STREAMS_PER_SESSION = 64
"""Data streams one session may open (``TransferSettings.streams`` is at most 64)."""

SESSION_IDLE_S = 60.0
"""A session with no stream open ends after this long without a request."""

REPLAY_WINDOW = 1024
"""Control requests of a session may arrive out of order by up to this many sequence
numbers (a peer's threads send on more than one socket); each number is accepted once."""

_SEQ = struct.Struct("<Q")
_INDEX = struct.Struct("<I")


def mac(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts`` under ``key``."""
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def session_key(
    secret: bytes | None, initiator_nonce: bytes, responder_nonce: bytes, principal: str
) -> bytes:
    """The key both ends derive at the end of a handshake (never sent)."""
    return mac(
        secret or b"", b"kvbridge-session", initiator_nonce, responder_nonce, principal.encode()
    )


def call_mac(key: bytes, session_id: bytes, op: str, seq: int, body: bytes) -> bytes:
    return mac(key, b"kvbridge-call", session_id, op.encode(), _SEQ.pack(seq), body)


def stream_hello(session_id: bytes, key: bytes, index: int) -> bytes:
    """The HELLO body that admits one data stream of the session."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    proof = mac(key, b"kvbridge-stream", session_id, nonce, _INDEX.pack(index))
    return session_id + nonce + proof


class SessionsFull(AuthenticationError):
    """Every session slot is held by a session with open streams: try again later."""


@dataclass(frozen=True)
class Caller:
    """Who sent a request or opened a stream: the session's serial number (unique for the
    engine's lifetime, never reused), the name the peer gave at its handshake (for logs
    only: a peer chooses its name) and the principal it proved it speaks for (see
    ``_keyring``: what the application decides and counts by)."""

    session: int
    peer: str
    principal: str = ""


@dataclass
class Credentials:
    """A client's side of a session: it signs each control request with the key."""

    id: bytes
    key: bytes
    _seqs: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def sign(self, op: str, body: bytes) -> dict[str, Any]:
        seq = next(self._seqs)
        proof = call_mac(self.key, self.id, op, seq, body)
        return {"op": op, "session": self.id, "seq": seq, "body": body, "mac": proof}

    def hello(self, index: int) -> bytes:
        return stream_hello(self.id, self.key, index)


@dataclass
class Session:
    id: bytes
    key: bytes
    caller: Caller
    seq: int = 0
    """The highest request sequence number seen."""
    seen: set[int] = field(default_factory=set)
    """Sequence numbers seen within the replay window below ``seq``."""
    streams: int = 0
    nonces: set[bytes] = field(default_factory=set)
    last_used: float = 0.0

    def accept_seq(self, seq: int) -> bool:
        """Take ``seq`` once, if it is inside the replay window."""
        if seq <= self.seq - REPLAY_WINDOW or seq in self.seen:
            return False
        self.seen.add(seq)
        if seq > self.seq:
            self.seq = seq
            if len(self.seen) > 2 * REPLAY_WINDOW:
                self.seen = {s for s in self.seen if s > seq - REPLAY_WINDOW}
        return True


class SessionTable:
    """The engine's sessions; thread-safe (the control thread and serving threads use it)."""

    def __init__(
        self,
        *,
        max_sessions: int = MAX_SESSIONS,
        idle_s: float = SESSION_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.on_end: Callable[[Caller], None] | None = None
        self._max = max_sessions
        self._idle_s = idle_s
        self._clock = clock
        self._sessions: OrderedDict[bytes, Session] = OrderedDict()  # least recently used first
        self._ids: dict[int, bytes] = {}  # serial -> session id
        self._per_principal: Counter[str] = Counter()  # open sessions by principal
        self._streams_by: Counter[str] = Counter()  # open streams by principal
        self._stream_limits: dict[str, int | None] = {}
        self._serials = itertools.count(1)
        self._lock = threading.Lock()

    def open(
        self,
        key: bytes,
        peer: str,
        principal: str = "",
        limit: int = MAX_SESSIONS,
        streams: int | None = None,
    ) -> Session:
        """A new session after a successful handshake, for ``principal``, which may have
        at most ``limit`` sessions and ``streams`` data streams (all its sessions together;
        ``None``: no bound of its own) at once; may end idle streamless ones (of that
        principal first when it is at its limit, so that it never pushes out another's)."""
        with self._lock:
            self._stream_limits[principal] = streams
            ended, full = self._make_room(principal, limit)
            if full is None:
                session = Session(
                    secrets.token_bytes(SESSION_ID_BYTES),
                    key,
                    Caller(next(self._serials), peer, principal),
                    last_used=self._clock(),
                )
                self._sessions[session.id] = session
                self._ids[session.caller.session] = session.id
                self._per_principal[principal] += 1
        self._notify(ended)  # outside the lock: the handler takes the application's locks
        if full is not None:
            raise full
        return session

    def verify_call(
        self, session_id: bytes, op: str, seq: int, body: bytes, proof: bytes
    ) -> Caller:
        """The caller of a control request, or :class:`AuthenticationError`."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise AuthenticationError("unknown or ended session")
            expected = call_mac(session.key, session_id, op, seq, body)
            if not hmac.compare_digest(expected, proof):
                raise AuthenticationError("bad request signature")
            if not session.accept_seq(seq):
                raise AuthenticationError(f"request {seq} replayed or too late")
            session.last_used = self._clock()
            self._sessions.move_to_end(session_id)
            return session.caller

    def admit_stream(self, hello: bytes, index: int) -> Caller:
        """Check a data stream's HELLO body; count the stream as open on success."""
        if len(hello) != HELLO_BYTES:
            raise AuthenticationError("malformed stream greeting")
        session_id = hello[:SESSION_ID_BYTES]
        nonce = hello[SESSION_ID_BYTES : SESSION_ID_BYTES + NONCE_BYTES]
        proof = hello[SESSION_ID_BYTES + NONCE_BYTES :]
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                raise AuthenticationError("unknown or ended session")
            expected = mac(session.key, b"kvbridge-stream", session_id, nonce, _INDEX.pack(index))
            if not hmac.compare_digest(expected, proof):
                raise AuthenticationError("bad stream greeting signature")
            if nonce in session.nonces:
                raise AuthenticationError("stream greeting replayed")
            if len(session.nonces) >= MAX_STREAMS_PER_SESSION:
                raise AuthenticationError(
                    f"a session opens at most {MAX_STREAMS_PER_SESSION} streams"
                )
            principal = session.caller.principal
            most = self._stream_limits.get(principal)
            if most is not None and self._streams_by[principal] >= most:
                raise AuthenticationError(
                    f"principal {principal or 'default'} has {most} streams open: close some"
                )
            session.nonces.add(nonce)
            session.streams += 1
            self._streams_by[principal] += 1
            session.last_used = self._clock()
            return session.caller

    def stream_closed(self, caller: Caller) -> None:
        """One of the session's streams closed; the session ends with its last stream."""
        ended: list[Caller] = []
        with self._lock:
            self._streams_by[caller.principal] -= 1
            session = self._sessions.get(self._ids.get(caller.session, b""))
            if session is not None:
                session.streams -= 1
                if session.streams <= 0:
                    self._pop(session.id)
                    ended.append(caller)
        self._notify(ended)

    def alive(self, caller: Caller) -> bool:
        """Whether the session is still open."""
        with self._lock:
            return caller.session in self._ids

    def end(self, session_id: bytes) -> None:
        """End a session now (the peer said goodbye)."""
        with self._lock:
            session = self._pop(session_id)
        if session is not None:
            self._notify([session.caller])

    def sweep(self) -> None:
        """End streamless sessions idle for longer than ``idle_s``."""
        with self._lock:
            ended = self._expire_idle()
        self._notify(ended)

    # -- internals (under the lock) -----------------------------------------------------

    def _expire_idle(self) -> list[Caller]:
        cutoff = self._clock() - self._idle_s
        idle = [
            sid for sid, s in self._sessions.items() if s.streams <= 0 and s.last_used <= cutoff
        ]
        return [s.caller for s in (self._pop(sid) for sid in idle) if s is not None]

    def _make_room(self, principal: str, limit: int) -> tuple[list[Caller], SessionsFull | None]:
        """Sessions ended to make room for one more of ``principal``, and why there is
        none if there is none."""
        ended: list[Caller] = []
        if self._per_principal[principal] >= limit:
            ended = self._evict_one(principal)
            if self._per_principal[principal] >= limit:
                who = principal or "default"
                return ended, SessionsFull(
                    f"principal {who} has {limit} sessions with open streams: try again later"
                )
        if len(self._sessions) >= self._max:
            ended += self._expire_idle() or self._evict_one()
        if len(self._sessions) >= self._max:
            return ended, SessionsFull(f"{self._max} sessions with open streams: try again later")
        return ended, None

    def _evict_one(self, principal: str | None = None) -> list[Caller]:
        """End the least recently used session without a stream (of ``principal`` only,
        when given)."""
        for sid, session in self._sessions.items():  # least recently used first
            mine = principal is None or session.caller.principal == principal
            if mine and session.streams <= 0:
                self._pop(sid)
                return [session.caller]
        return []

    def _pop(self, session_id: bytes) -> Session | None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self._ids.pop(session.caller.session, None)
            self._per_principal[session.caller.principal] -= 1
        return session

    def _notify(self, ended: list[Caller]) -> None:
        handler = self.on_end
        if handler is not None:
            for caller in ended:
                handler(caller)
