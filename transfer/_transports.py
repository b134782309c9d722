"""Transports: how data-stream pipes are opened and accepted. They move bytes, nothing else.

``tcp``: a listening socket on the engine's host, one connection per stream.
``memory``: in-process pipes between engines of one process (tests, single-process use).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

from .._bounded_log import BoundedLog
from ._errors import PeerClosed
from ._pipes import MemoryPipe, Pipe, SocketPipe

_log = logging.getLogger("kvbridge.transfer")
_failures = BoundedLog(_log)
"""Accept failures, at a bounded rate: a burst of them (out of descriptors, peers that
reset at once) must not write a line each."""
_ACCEPT_BACKOFF_S = 0.05
"""Pause after a failed accept (no file descriptor left): a retry at once would spin."""
_BACKLOG = 1024
"""Connections the kernel queues for accept (capped by ``net.core.somaxconn``): a burst of
strangers must not leave a real peer's connect to time out in a full queue."""
_ACCEPTS_PER_PASS = 256
"""Accepts between two looks at the silent connections (one of them may have spoken)."""
MAX_SILENT = 64
"""Connections of a data port that sent nothing yet, held at once; past it the oldest is
closed. A peer greets in its first bytes, within a round trip of connecting."""
DEFAULT_SILENT_TIMEOUT_S = 10.0
"""A connection that sent nothing for this long is closed (the engine's connect timeout)."""

Accept = Callable[[Pipe], None]
"""Called with each pipe a peer opens; the engine serves it on a thread it owns."""


class Transport(Protocol):
    name: str
    frame_bytes: int
    """Smallest frame size that suits the transport (the engine uses at least this)."""
    device_memory: bool
    """Whether its pipes can carry GPU memory (cupy arrays) as well as host memory."""

    def address(self) -> dict[str, Any]:
        """How peers reach this transport (goes into the engine's metadata)."""

    def open(self, address: dict[str, Any], timeout: float) -> Pipe:
        """Open one pipe to a peer's transport at ``address``."""

    def close(self) -> None:
        """Stop accepting (pipes already open are closed by their owners)."""


class TcpDialer:
    """TCP streams this engine opens, and none it accepts: a dial-only engine's (a
    cache client's). No listening socket, no thread."""

    name = "tcp"
    frame_bytes = 0
    device_memory = False

    def __init__(self, *, socket_buffer: int) -> None:
        self._socket_buffer = socket_buffer

    def address(self) -> dict[str, Any]:
        return {}  # nothing to reach

    def open(self, address: dict[str, Any], timeout: float) -> Pipe:
        host, port = str(address["host"]), int(address["port"])
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise PeerClosed(f"cannot open a TCP stream to {host}:{port}: {exc}") from exc
        tune(sock, self._socket_buffer)
        sock.settimeout(None)
        return SocketPipe(sock)

    def close(self) -> None:
        return


def tune(sock: socket.socket, socket_buffer: int) -> None:
    """``socket_buffer`` bytes of send and receive buffer (0: the kernel's own sizing)."""
    if socket_buffer:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, socket_buffer)


class TcpTransport:
    """TCP streams: zero-copy ``sendmsg``/``recvmsg_into`` on each connection.

    A connection is handed to the engine (a thread each) only once its first bytes came:
    until then the accept thread holds it in a selector, at most :data:`MAX_SILENT` of
    them (the oldest closed past that) and each for at most ``silent_timeout`` seconds. A
    peer opens a stream and greets at once, so connections that sit silent (strangers
    holding descriptors) cost neither a thread nor a place among the served streams."""

    name = "tcp"
    frame_bytes = 0
    device_memory = False

    def __init__(
        self,
        host: str,
        port: int,
        accept: Accept,
        *,
        socket_buffer: int,
        silent_timeout: float = DEFAULT_SILENT_TIMEOUT_S,
    ) -> None:
        self._accept = accept
        self._socket_buffer = socket_buffer
        self._dialer = TcpDialer(socket_buffer=socket_buffer)
        self._silent_timeout = silent_timeout
        self._listener = socket.create_server((host, port), backlog=_BACKLOG)
        self._listener.setblocking(False)
        self._host = host
        self._port = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._silent: OrderedDict[socket.socket, float] = OrderedDict()
        """Connections that sent nothing yet, by when they were accepted (oldest first)."""
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="kvbridge-tcp-accept", daemon=True)
        self._closed = False
        self._thread.start()

    def address(self) -> dict[str, Any]:
        return {"host": self._host, "port": self._port}

    def open(self, address: dict[str, Any], timeout: float) -> Pipe:
        return self._dialer.open(address, timeout)

    def _run(self) -> None:
        """Accept until closed. A failure to accept (out of file descriptors) or to serve
        one connection is logged and the loop goes on: one bad moment must not stop every
        later put and get."""
        try:
            while not self._closed:
                for key, _ in self._selector.select(self._next_timeout()):
                    try:
                        self._ready(key.fileobj)
                    except Exception as exc:  # one connection's trouble never ends the loop
                        _failures.refused(
                            "serve", logging.ERROR, "tcp: a connection failed: %r", exc
                        )
                self._expire()
        finally:
            for sock in self._silent:
                sock.close()
            self._silent.clear()

    def _accept_waiting(self) -> None:
        """Take every connection waiting in the backlog (a few hundred at most a pass)."""
        for _ in range(_ACCEPTS_PER_PASS):
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if not self._closed:
                    _failures.refused("accept", logging.ERROR, "tcp: accept failed: %s", exc)
                    time.sleep(_ACCEPT_BACKOFF_S)
                return
            self._silent[sock] = time.monotonic()
            self._selector.register(sock, selectors.EVENT_READ)
            if len(self._silent) > MAX_SILENT:
                self._drop(next(iter(self._silent)), "silent")

    def _spoke(self, sock: socket.socket) -> None:
        """Its first bytes came: the engine serves it from here on."""
        self._selector.unregister(sock)
        del self._silent[sock]
        try:
            sock.setblocking(True)
            tune(sock, self._socket_buffer)
            self._accept(SocketPipe(sock))
        except Exception as exc:  # a peer that reset at once, say: one line per interval
            _failures.refused(
                "serve", logging.ERROR, "tcp: a connection could not be served: %r", exc
            )
            sock.close()

    def _ready(self, fileobj: Any) -> None:
        """One readable socket of this pass: the listener, or a silent connection that
        spoke (unless the accepts before it in the same pass closed it already)."""
        if fileobj is self._listener:
            self._accept_waiting()
        elif fileobj in self._silent:
            self._spoke(fileobj)

    def _expire(self) -> None:
        deadline = time.monotonic() - self._silent_timeout
        while self._silent and next(iter(self._silent.values())) < deadline:
            self._drop(next(iter(self._silent)), "silent_timeout")

    def _next_timeout(self) -> float | None:
        if not self._silent:
            return None
        oldest = next(iter(self._silent.values()))
        return max(0.0, oldest + self._silent_timeout - time.monotonic())

    def _drop(self, sock: socket.socket, why: str) -> None:
        self._selector.unregister(sock)
        del self._silent[sock]
        sock.close()
        _failures.refused(why, logging.INFO, "tcp: a connection that sent nothing closed (%s)", why)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"!")
        self._thread.join()
        self._selector.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()


_MEMORY_ENDPOINTS: dict[str, Accept] = {}
_MEMORY_LOCK = threading.Lock()


class MemoryTransport:
    """Pipes between engines of this process, found by a random name."""

    name = "memory"
    frame_bytes = 0
    device_memory = False

    def __init__(self, accept: Accept | None) -> None:
        """``accept``: pipes other engines open to this one (``None``: it only dials)."""
        self._name = secrets.token_hex(8)
        if accept is not None:
            with _MEMORY_LOCK:
                _MEMORY_ENDPOINTS[self._name] = accept

    def address(self) -> dict[str, Any]:
        return {"name": self._name}

    def open(self, address: dict[str, Any], timeout: float) -> Pipe:
        with _MEMORY_LOCK:
            accept = _MEMORY_ENDPOINTS.get(str(address["name"]))
        if accept is None:
            raise PeerClosed("no engine with that memory endpoint in this process")
        mine, theirs = MemoryPipe.pair()
        accept(theirs)
        return mine

    def close(self) -> None:
        with _MEMORY_LOCK:
            _MEMORY_ENDPOINTS.pop(self._name, None)
