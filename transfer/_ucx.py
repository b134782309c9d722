"""The UCX transport, through ucxx: shared memory on one host, TCP (or RDMA) between hosts.

ucxx 0.52 offers tag, stream and active-message operations but no RMA, so a UCX pipe
carries the same frames as a TCP stream, as tagged messages: a frame's 24-byte header, its
body (descriptors or a control message), then its payloads. A payload of 64 KiB or more is
its own message, sent from and received straight into the registered region (UCX moves
large messages by rendezvous: nothing is staged); runs of smaller payloads travel packed in
one message and are copied once on each side, which costs less than a message per op.

GPU regions (cupy arrays) are posted to UCX as they are: UCX moves them with CUDA IPC on
one host and GPUDirect RDMA between hosts where the hardware has it (else it stages them
itself). Packed runs of small GPU payloads are copied through host memory.

Every UCX call runs on one thread per transport (`_ucx_worker.Worker`), which also drives the
worker in blocking mode (``arm`` then ``poll`` on its event fd: no busy loop); stream
threads hand it closures and wait on futures.

Endpoints are made from worker addresses exchanged through the engine metadata (no UCX
listener), so any transport UCX has may serve them. Between processes of one host (same
boot id) endpoints are created without peer-failure error handling: UCX's shared-memory
transports (posix, sysv) do not offer it, and with it UCX falls back to TCP. A peer that
dies is then noticed by the engine's transfer timeout rather than by UCX. Between hosts,
error handling stays on.

UCX settings kvbridge applies unless the matching ``UCX_*`` variable is set:
``TLS=^cma`` (every transport UCX has: RDMA, CUDA, shared memory, TCP; but not ``cma``,
which hangs where ptrace is restricted, as in containers) and
``TCP_RX_SEG_SIZE``/``TCP_TX_SEG_SIZE`` of 512K (the default segment caps UCX's TCP at
about 1.1 GB/s; 512K lifts it to 4-6 GB/s).
"""

from __future__ import annotations

import concurrent.futures
import secrets
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy

from ._device import is_device
from ._errors import PeerClosed
from ._pipes import Pipe, byte_views
from ._protocol import HEADER
from ._ucx_worker import Worker

_Worker = Worker  # the name benches/ use for raw ucxx baselines


PACK_BELOW_BYTES = 64 << 10
"""Payloads smaller than this travel packed with their neighbours (one message per run)."""

PACK_RUN_BYTES = 1 << 20
"""Most bytes packed into one message."""

CONNECT_BYTES = 4096
"""Fixed size of the connect message (a worker address is a few hundred bytes)."""

_CONNECT_TAG = 0xFFFFFFFF << 32
_CONNECT = struct.Struct("<I16sI")  # channel, host id, address length
_HEADER_BYTES = HEADER.size


def ucx_available() -> bool:
    """True when the ucxx bindings import (``pip install 'kvbridge[ucx]'``)."""
    try:
        import ucxx._lib.libucxx  # noqa: F401, PLC0415
    except Exception:
        return False
    return True


def host_id() -> bytes:
    """16 bytes that are equal for processes of one boot of one host."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            return bytes.fromhex(f.read().strip().replace(b"-", b"").decode())[:16]
    except OSError:
        return socket.gethostname().encode()[:16].ljust(16, b"\0")


def _pack(views: Sequence[Any]) -> bytes:
    """One message of small payloads; GPU views are copied to host memory first."""
    return b"".join(v.get() if is_device(v) else v for v in views)


def _unpack(staging: bytearray, views: Sequence[Any]) -> None:
    offset = 0
    for view in views:
        part = memoryview(staging)[offset : offset + view.nbytes]
        if is_device(view):
            view.set(numpy.frombuffer(part, numpy.uint8))
        else:
            view[:] = part
        offset += view.nbytes


def _runs(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """Group payloads into messages: ``(start, end)``; a run of small ones is packed."""
    runs = []
    i, count = 0, len(lengths)
    while i < count:
        end, total = i + 1, lengths[i]
        if lengths[i] < PACK_BELOW_BYTES:
            while (
                end < count
                and lengths[end] < PACK_BELOW_BYTES
                and total + lengths[end] <= PACK_RUN_BYTES
            ):
                total += lengths[end]
                end += 1
        runs.append((i, end))
        i = end
    return runs


class UcxPipe:
    """One stream over a UCX endpoint: tagged messages in two private channels."""

    device_memory = True

    def __init__(self, worker: _Worker, endpoint: Any, send_channel: int, recv_channel: int):
        self._worker = worker
        self._endpoint = endpoint
        self._send_channel = send_channel
        self._recv_channel = recv_channel
        self._send_seq = 0
        self._recv_seq = 0
        self._timeout: float | None = None
        self._closed = False
        self._endpoint_closed = False  # set on the worker thread, where sends are posted
        self._waiting: set[concurrent.futures.Future[Any]] = set()
        self._lock = threading.Lock()

    def _tags(self, channel: int, first: int, count: int) -> list[Any]:
        tag = self._worker.ucx.UCXXTag
        return [tag((channel << 32) | ((first + i) & 0xFFFFFFFF)) for i in range(count)]

    def send(self, buffers: Sequence[bytes | memoryview]) -> None:
        first, *views = byte_views(buffers)
        messages: list[Any] = [first[:_HEADER_BYTES]]
        if len(first) > _HEADER_BYTES:
            messages.append(first[_HEADER_BYTES:])
        for start, end in _runs([v.nbytes for v in views]):
            messages.append(views[start] if end - start == 1 else _pack(views[start:end]))
        tags = self._tags(self._send_channel, self._send_seq, len(messages))
        self._send_seq += len(messages)
        endpoint, array = self._endpoint, self._worker.Array
        if endpoint is None:
            raise EOFError("the UCX pipe is closed")

        def post() -> Any:
            if self._endpoint_closed:  # queued after close(): its endpoint.close() ran first
                return [], messages
            pairs = zip(messages, tags, strict=True)
            return [endpoint.tag_send(array(m), t) for m, t in pairs], messages

        # Sends complete in the background, so that many frames are in flight (as over TCP,
        # where sendall returns once the kernel has the bytes). The future's result keeps
        # the messages alive until UCX is done with them; the region bytes stay untouched
        # until the remote ACK anyway. A failed send closes the pipe: the receiving side
        # of this stream then sees the end, and the peer breaks.
        self._worker.call(post).add_done_callback(self._sent)

    def _sent(self, future: concurrent.futures.Future[Any]) -> None:
        if not future.cancelled() and future.exception() is not None:
            self.close()

    def _receive(self, buffers: list[Any]) -> None:
        tags = self._tags(self._recv_channel, self._recv_seq, len(buffers))
        self._recv_seq += len(buffers)
        worker, array = self._worker.worker, self._worker.Array

        def post() -> Any:
            return [worker.tag_recv(array(b), t) for b, t in zip(buffers, tags, strict=True)], None

        self._wait(self._worker.call(post))

    def recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        self._receive([buf])
        return bytes(buf)

    def recv_into_views(self, views: Sequence[memoryview]) -> None:
        targets: list[Any] = []
        unpack: list[tuple[bytearray, Sequence[memoryview]]] = []
        for start, end in _runs([v.nbytes for v in views]):
            if end - start == 1:
                targets.append(views[start])
            else:
                staging = bytearray(sum(v.nbytes for v in views[start:end]))
                targets.append(staging)
                unpack.append((staging, views[start:end]))
        self._receive(targets)
        for staging, parts in unpack:
            _unpack(staging, parts)

    def discard(self, lengths: Sequence[int]) -> None:
        self._receive([bytearray(sum(lengths[s:e])) for s, e in _runs(list(lengths))])

    def set_timeout(self, seconds: float | None) -> None:
        self._timeout = seconds

    def set_deadline(self, deadline: float | None) -> None:
        """UCX messages arrive whole (no trickling): each wait is bounded by what is left."""
        self._timeout = None if deadline is None else max(deadline - time.monotonic(), 1e-3)

    def _wait(self, future: concurrent.futures.Future[Any]) -> Any:
        with self._lock:
            if self._closed:
                future.cancel()
                raise EOFError("the UCX pipe is closed")
            self._waiting.add(future)
        try:
            return future.result(self._timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError("UCX operation timed out") from None
        except concurrent.futures.CancelledError:
            raise EOFError("the UCX pipe was closed") from None
        except self._worker.ucx.UCXError as exc:
            raise EOFError(f"UCX: {exc}") from exc
        finally:
            with self._lock:
                self._waiting.discard(future)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            waiting = list(self._waiting)
        for future in waiting:
            future.cancel()
        endpoint, self._endpoint = self._endpoint, None

        def close_endpoint() -> Any:  # on the worker thread, after every send queued before
            self._endpoint_closed = True
            return [], endpoint.close()

        self._worker.call(close_endpoint)


class UcxTransport:
    """Pipes over UCX endpoints made from worker addresses."""

    name = "ucx"
    device_memory = True
    frame_bytes = 64 << 20
    """A receiver posts a frame's payload receives together; each 1 MiB rendezvous waits on
    wake-ups, so more of them in flight is what hides that: one stream with 16 MiB frames
    moved 0.95 GB/s over shared memory, with 64 MiB frames 2.24 GB/s."""

    def __init__(self, accept: Callable[[Pipe], None]) -> None:
        self._accept = accept
        self._worker = _Worker()
        self._host = host_id()
        self._inbox = bytearray(CONNECT_BYTES)
        self._pipes: weakref.WeakSet[UcxPipe] = weakref.WeakSet()
        self._post_connect_recv()

    def address(self) -> dict[str, Any]:
        return {"worker": self._worker.address, "host": self._host}

    def _endpoint(self, address: bytes, host: bytes) -> Any:
        ucx = self._worker.ucx
        handling = host != self._host  # see the module docstring
        return ucx.UCXEndpoint.create_from_worker_address(
            self._worker.worker, ucx.UCXAddress.create_from_buffer(address), handling
        )

    def open(self, address: dict[str, Any], timeout: float) -> Pipe:
        their_address, their_host = bytes(address["worker"]), bytes(address["host"])
        channel = secrets.randbelow(2**30) + 1
        message = bytearray(CONNECT_BYTES)
        own = self._worker.address
        _CONNECT.pack_into(message, 0, channel, self._host, len(own))
        message[_CONNECT.size : _CONNECT.size + len(own)] = own
        array, tag = self._worker.Array, self._worker.ucx.UCXXTag(_CONNECT_TAG)
        holder: list[Any] = []

        def connect() -> Any:
            endpoint = self._endpoint(their_address, their_host)
            holder.append(endpoint)
            return [endpoint.tag_send(array(message), tag)], None

        try:
            self._worker.call(connect).result(timeout)
        except Exception as exc:
            raise PeerClosed(f"cannot open a UCX stream: {exc}") from exc
        pipe = UcxPipe(self._worker, holder[0], 2 * channel, 2 * channel + 1)
        self._pipes.add(pipe)
        return pipe

    def _post_connect_recv(self) -> None:
        inbox, array = self._inbox, self._worker.Array
        tag = self._worker.ucx.UCXXTag(_CONNECT_TAG)
        worker = self._worker.worker
        future = self._worker.call(lambda: ([worker.tag_recv(array(inbox), tag)], None))
        future.add_done_callback(self._on_connect)

    def _on_connect(self, future: concurrent.futures.Future[Any]) -> None:
        if future.exception() is not None:
            return  # the transport is closing
        channel, host, length = _CONNECT.unpack_from(self._inbox, 0)
        address = bytes(self._inbox[_CONNECT.size : _CONNECT.size + length])
        self._post_connect_recv()
        holder: list[Any] = []

        def create() -> Any:
            holder.append(self._endpoint(address, host))
            return [], None

        def made(done: concurrent.futures.Future[Any]) -> None:
            if done.exception() is None:
                pipe = UcxPipe(self._worker, holder[0], 2 * channel + 1, 2 * channel)
                self._pipes.add(pipe)
                self._accept(pipe)

        self._worker.call(create).add_done_callback(made)

    def close(self) -> None:
        for pipe in list(self._pipes):
            pipe.close()
        self._worker.close()
