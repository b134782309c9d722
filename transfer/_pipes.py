"""Byte pipes: the only thing a transport provides to the stream logic.

A pipe moves bytes between two ends and decides nothing (the protocol and the streams do).
:class:`SocketPipe` is a TCP connection using ``sendmsg`` / ``recvmsg_into`` over lists of
memoryviews (scatter/gather: no payload is ever joined or copied in Python);
:class:`MemoryPipe` is an in-process pair for tests and single-process use.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from ._device import is_device

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
"""Most buffers one sendmsg/recvmsg_into call takes (1024 on Linux)."""

SCATTER_BELOW_BYTES = 256 << 10
"""Views smaller than this move by scatter/gather (``sendmsg``/``recvmsg_into`` over many
views: one system call for many small ops; 64 KiB ops ran 1.2x raw sockets this way and
0.93x one by one). A larger view gets its own ``sendall``/``recv_into`` loop, which costs
less Python per call (1 MiB ops: 0.90x raw with one 16 MiB sendmsg per frame, 0.95x so)."""

HOT_BYTES = 256 << 10
"""A receive that reports its progress (``landed``) takes about this much per system call
at most, so that what the caller does with the landed views (hash them) finds them still in
the core's cache."""

READY_BYTES = 1 << 20
"""A send that asks its caller to make views ready (``ready``: hash them) does so about this
much at a time, each stretch just before it goes. Measured on two cores, 32 KiB pages: at
256 KiB a saving client moved 0.38-0.40 of raw TCP's throughput on loopback
(``bench_engine_pages.py``) against 0.49-0.54 at 1 MiB and 0.54-0.57 at 4 MiB; on a link
shaped to 8 Gbit/s a put kept 0.94-0.98 of its throughput without checksums at 1 MiB
against 0.90-0.91 at 4 MiB (``bench_checksums.py``)."""

_DISCARD_BYTES = 1 << 20


class Pipe(Protocol):
    device_memory: bool
    """True when views may be GPU memory (cupy arrays) as well as memoryviews."""
    byte_stream: bool
    """True when a frame's payloads are one stream of bytes, however the views cut it (a
    socket, memory); False when each payload is a message of its own (UCX)."""

    def recv_exact(self, n: int) -> bytes:
        """Exactly ``n`` bytes; ``EOFError`` if the other end closed first."""

    def recv_into_views(
        self, views: Sequence[memoryview], landed: Callable[[int], None] | None = None
    ) -> None:
        """Fill every view in order; ``EOFError`` if the other end closed first. Returns or
        raises only once no byte can land in the views any more (the caller may then hand
        their memory to someone else). ``landed(n)``, where the pipe can tell, as soon as
        the first ``n`` views are full (and about ``HOT_BYTES`` at most land in between)."""

    def discard(self, lengths: Sequence[int]) -> None:
        """Read and drop the payloads of refused ops (one length per op)."""

    def send(
        self, buffers: Sequence[bytes | memoryview], ready: Callable[[int], None] | None = None
    ) -> None:
        """Send every buffer in order, whole, calling ``ready(n)`` before the first ``n``
        go (about ``READY_BYTES`` at a time where the pipe can: the caller hashes them while
        the bytes before them are on their way). The buffers may still be read
        after it returns, until :meth:`flush` (a transport that sends in the background)."""

    def flush(self) -> None:
        """Return once no buffer passed to :meth:`send` is read any more: sent, or dropped
        with the stream (raises as ``send`` does then)."""

    def set_timeout(self, seconds: float | None) -> None:
        """Bound each blocking call (``TimeoutError``), or ``None`` for no bound."""

    def set_deadline(self, deadline: float | None) -> None:
        """Bound everything until further notice by ``deadline`` (``time.monotonic()``):
        calls raise ``TimeoutError`` once past it, however the bytes trickle in; ``None``
        lifts it. A call blocked on a peer that sends nothing at all may wait beyond it
        (pair it with :meth:`set_timeout`, or close the pipe from another thread)."""

    def close(self) -> None:
        """Close both directions; blocked calls on either end wake up with an error."""


class SocketPipe:
    """A connected stream socket."""

    device_memory = False
    byte_stream = True

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._scratch: bytearray | None = None  # for discards only, made on first use
        self._deadline: float | None = None

    def _check_deadline(self) -> None:
        if self._deadline is not None and time.monotonic() > self._deadline:
            raise TimeoutError("the stream missed its deadline")

    def recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise EOFError("the peer closed the stream")
            got += k
            if got < n:
                self._check_deadline()
        return bytes(buf)

    def recv_into_views(
        self, views: Sequence[memoryview], landed: Callable[[int], None] | None = None
    ) -> None:
        sock = self.sock
        i, count = 0, len(views)
        while i < count:
            view = views[i]
            if view.nbytes >= SCATTER_BELOW_BYTES:
                # A big view: the tightest loop there is (each call costs Python time, and a
                # loopback read returns ~64 KiB at a time).
                while view:
                    k = sock.recv_into(view)
                    if k == 0:
                        raise EOFError("the peer closed the stream")
                    view = view[k:]
                    if self._deadline is not None:
                        self._check_deadline()
                i += 1
                if landed is not None:
                    landed(i)
                continue
            end = _small_run(views, i)
            self._scatter(list(views[i:end]), i, landed)
            i = end

    def _scatter(
        self, pending: list[memoryview], base: int, landed: Callable[[int], None] | None
    ) -> None:
        """Fill small views with as few ``recvmsg_into`` calls as the data allows (with
        ``landed``, calls of about ``HOT_BYTES``, each reported)."""
        first = 0
        while first < len(pending):
            end = len(pending) if landed is None else _run_end(pending, first, HOT_BYTES)
            k = self.sock.recvmsg_into(pending[first:end])[0]
            if k == 0:
                raise EOFError("the peer closed the stream")
            full = _advance(pending, first, k)
            if landed is not None and full > first:
                landed(base + full)
            first = full
            self._check_deadline()

    def discard(self, lengths: Sequence[int]) -> None:
        n = sum(lengths)
        if self._scratch is None:
            self._scratch = bytearray(_DISCARD_BYTES)
        view = memoryview(self._scratch)
        while n:
            k = self.sock.recv_into(view[: min(n, len(view))])
            if k == 0:
                raise EOFError("the peer closed the stream")
            n -= k
            self._check_deadline()

    def send(
        self, buffers: Sequence[bytes | memoryview], ready: Callable[[int], None] | None = None
    ) -> None:
        """Small buffers go out together with ``sendmsg`` (gather), each big one with its own
        ``sendall``: one huge sendmsg of a 16 MiB frame measured 5% slower on loopback."""
        if len(buffers) == 1 and type(buffers[0]) is bytes and ready is None:  # an ACK
            self.sock.sendall(buffers[0])
            return
        pending = byte_views(buffers)
        first = told = 0
        sock = self.sock
        while first < len(pending):
            if pending[first].nbytes >= SCATTER_BELOW_BYTES:
                if ready is not None:
                    ready(first + 1)
                sock.sendall(pending[first])
                first += 1
                continue
            end = _small_run(pending, first)
            if ready is not None:
                end = min(end, _run_end(pending, first, READY_BYTES))
                if end > told:
                    ready(told := end)
            first = _advance(pending, first, sock.sendmsg(pending[first:end]))
            self._check_deadline()

    def flush(self) -> None:
        """Nothing to wait for: ``sendall`` returns once the kernel holds the bytes."""

    def set_timeout(self, seconds: float | None) -> None:
        self.sock.settimeout(seconds)

    def set_deadline(self, deadline: float | None) -> None:
        """The loops check ``deadline`` between system calls: a peer trickling a byte at a
        time cannot stretch it. No socket timeout is set for it (a socket in timeout mode
        polls before every call: 10% of a served stream's throughput)."""
        self._deadline = deadline

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def byte_views(buffers: Sequence[bytes | memoryview]) -> list[memoryview]:
    """Byte-format memoryviews of ``buffers``. Region views already are (cast once at
    registration), so only headers get wrapped: casting all 1,024 views of a frame again
    cost ~120 us, checking them ~50 us. GPU region views (cupy arrays) pass unchanged."""
    return [
        b  # type: ignore[misc]  # a GPU view is not a memoryview, but is used like one
        if (type(b) is memoryview and b.format == "B") or is_device(b)
        else memoryview(b).cast("B")
        for b in buffers
    ]


def _small_run(views: Sequence[memoryview], first: int) -> int:
    """End of the run of small views starting at ``first`` (at most IOV_MAX of them)."""
    end = first + 1
    limit = min(len(views), first + IOV_MAX)
    while end < limit and views[end].nbytes < SCATTER_BELOW_BYTES:
        end += 1
    return end


def _run_end(views: Sequence[memoryview], first: int, nbytes: int) -> int:
    """Where a call from ``first`` that should move about ``nbytes`` ends (at least one
    view; a frame's header counts as little as it weighs)."""
    end, total = first, 0
    while end < len(views) and total < nbytes:
        total += views[end].nbytes
        end += 1
    return end


def _advance(views: list[memoryview], first: int, count: int) -> int:
    """Drop ``count`` moved bytes from the front of ``views[first:]``; return the new first."""
    while count:
        size = views[first].nbytes
        if count >= size:
            count -= size
            first += 1
        else:
            views[first] = views[first][count:]
            count = 0
    while first < len(views) and views[first].nbytes == 0:
        first += 1
    return first


class _Channel:
    """One direction of a memory pipe."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False
        self.cond = threading.Condition()


class MemoryPipe:
    """One end of an in-process pipe (``MemoryPipe.pair()``). Payloads are copied once."""

    device_memory = False
    byte_stream = True

    def __init__(self, inbox: _Channel, outbox: _Channel) -> None:
        self._inbox = inbox
        self._outbox = outbox
        self._timeout: float | None = None
        self._deadline: float | None = None

    @classmethod
    def pair(cls) -> tuple[MemoryPipe, MemoryPipe]:
        a, b = _Channel(), _Channel()
        return cls(a, b), cls(b, a)

    def _take(self, n: int) -> memoryview:
        """Wait for at least one byte (up to ``n``) and return it."""
        box = self._inbox
        timeout = self._timeout
        if self._deadline is not None:
            left = max(self._deadline - time.monotonic(), 0.0)
            timeout = left if timeout is None else min(timeout, left)
        with box.cond:
            if not box.cond.wait_for(lambda: box.data or box.closed, timeout):
                raise TimeoutError("memory pipe read timed out")
            if not box.data:
                raise EOFError("the peer closed the stream")
            chunk = bytes(box.data[:n])
            del box.data[:n]
            return memoryview(chunk)

    def recv_exact(self, n: int) -> bytes:
        parts = []
        while n:
            chunk = self._take(n)
            parts.append(bytes(chunk))
            n -= len(chunk)
        return b"".join(parts)

    def recv_into_views(
        self, views: Sequence[memoryview], landed: Callable[[int], None] | None = None
    ) -> None:
        for i, view in enumerate(views):
            got = 0
            while got < view.nbytes:
                chunk = self._take(view.nbytes - got)
                view[got : got + len(chunk)] = chunk
                got += len(chunk)
            if landed is not None:
                landed(i + 1)

    def discard(self, lengths: Sequence[int]) -> None:
        n = sum(lengths)
        while n:
            n -= len(self._take(n))

    def send(
        self, buffers: Sequence[bytes | memoryview], ready: Callable[[int], None] | None = None
    ) -> None:
        if ready is not None:
            ready(len(buffers))
        box = self._outbox
        with box.cond:
            if box.closed or self._inbox.closed:
                raise BrokenPipeError("the memory pipe is closed")
            for buffer in buffers:
                box.data += buffer
            box.cond.notify_all()

    def flush(self) -> None:
        """Nothing to wait for: ``send`` copied the bytes."""

    def set_timeout(self, seconds: float | None) -> None:
        self._timeout = seconds

    def set_deadline(self, deadline: float | None) -> None:
        self._deadline = deadline

    def close(self) -> None:
        for box in (self._inbox, self._outbox):
            with box.cond:
                box.closed = True
                box.cond.notify_all()
