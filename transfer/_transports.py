"""Transports: how data-stream pipes are opened and accepted. They move bytes, nothing else.

``tcp``: a listening socket on the engine's host, one connection per stream.
``memory``: in-process pipes between engines of one process (tests, single-process use).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
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


class TcpTransport:
    """TCP streams: zero-copy ``sendmsg``/``recvmsg_into`` on each connection."""

    name = "tcp"
    frame_bytes = 0
    device_memory = False

    def __init__(self, host: str, port: int, accept: Accept, *, socket_buffer: int) -> None:
        self._accept = accept
        self._socket_buffer = socket_buffer
        self._listener = socket.create_server((host, port), backlog=128)
        self._host = host
        self._port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._run, name="kvbridge-tcp-accept", daemon=True)
        self._closed = False
        self._thread.start()

    def address(self) -> dict[str, Any]:
        return {"host": self._host, "port": self._port}

    def open(self, address: dict[str, Any], timeout: float) -> Pipe:
        host, port = str(address["host"]), int(address["port"])
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise PeerClosed(f"cannot open a TCP stream to {host}:{port}: {exc}") from exc
        self._tune(sock)
        sock.settimeout(None)
        return SocketPipe(sock)

    def _tune(self, sock: socket.socket) -> None:
        if self._socket_buffer:
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                sock.setsockopt(socket.SOL_SOCKET, option, self._socket_buffer)

    def _run(self) -> None:
        """Accept until closed. A failure to accept (out of file descriptors) or to serve
        one connection is logged and the loop goes on: one bad moment must not stop every
        later put and get."""
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return
                _failures.refused("accept", logging.ERROR, "tcp: accept failed: %s", exc)
                time.sleep(_ACCEPT_BACKOFF_S)
                continue
            if self._closed:
                sock.close()
                return
            try:
                self._tune(sock)
                self._accept(SocketPipe(sock))
            except Exception as exc:  # a peer that reset at once, say: one line per interval
                _failures.refused(
                    "serve", logging.ERROR, "tcp: a connection could not be served: %r", exc
                )
                sock.close()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join()


_MEMORY_ENDPOINTS: dict[str, Accept] = {}
_MEMORY_LOCK = threading.Lock()


class MemoryTransport:
    """Pipes between engines of this process, found by a random name."""

    name = "memory"
    frame_bytes = 0
    device_memory = False

    def __init__(self, accept: Accept) -> None:
        self._name = secrets.token_hex(8)
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
