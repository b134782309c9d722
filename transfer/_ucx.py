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

Opening a stream. Tags are matched worker-wide, whichever endpoint a message came by, so
each side chooses the channel it receives a stream on, and nobody else: the opening side
sends the listener's worker a CONNECT (the connect key from the listener's metadata, the
channel it will receive on, its worker address); the listener answers with ACCEPT, the
first message on that channel, naming the channel it receives the stream on. A channel is
drawn at random among those its worker does not use: no two streams of a worker share
one, whatever a peer sends, and a channel always fits the 32 bits it has in a tag
(``channel << 32 | control << 31 | sequence``, the sequence number wrapping at 2**31). A
CONNECT without the right key is dropped before its address is read: UCX unpacks worker
addresses without checking them (a malformed one aborts or crashes the process), so only
peers that passed the control plane's handshake (which hands out the metadata, and with it
the key) get that far, and a stranger's messages open no stream and cost no thread.

Closing a stream. UCX does not tell a peer that an endpoint went away, so a closing pipe
first sends an end-of-stream message, which each side's pipe waits for from the start (a
closed stream then looks to the peer as a TCP FIN does). Then it closes its endpoint with
``close_blocking``, which cancels every request on it: the receives still posted, and,
because every endpoint is made with peer-failure error handling, rendezvous already matched
and half done, which a plain cancel leaves running (bytes from a peer that resumes would
land after the failure was reported: in freed memory, or in a slot handed to someone
else). A receive, a ``flush`` or an ``open`` returns or raises only once UCX says each of
its requests is finished or cancelled. UCX's shared-memory transports offer peer-failure
handling only with ``MM_ERROR_HANDLING=y``, which kvbridge sets (without it UCX would move
same-host streams over TCP). Checked here over shared memory and TCP (a SIGSTOPped peer
resumed after the close: no byte landed); not checked, for want of the hardware, is a
rendezvous the peer drives by writing into this process's memory itself: an RDMA put needs
the connection the closed endpoint tore down, but a CUDA IPC put is the peer's own copy,
and ``UCX_RNDV_SCHEME=get_zcopy`` would keep every copy on the receiving side.

A peer that dies or freezes without closing is noticed by the protocol's keepalive
(``_protocol``), on every transport.

What UCX does not check, and this module cannot: a tag receive accepts a message shorter
than its buffer as if it were whole (ucxx 0.52 drops the received length:
rapidsai/ucxx#104), so a peer that sends less than its frame says has it acknowledged, the
rest of the destination unchanged; and UCX keeps every message for a tag nobody receives
on until someone does, so anyone who can reach the worker can make it buffer them. The
UCX transport belongs among hosts that trust each other (see the README).

UCX settings kvbridge applies unless the matching ``UCX_*`` variable is set:
``TLS=^cma`` (every transport UCX has: RDMA, CUDA, shared memory, TCP; but not ``cma``,
which hangs where ptrace is restricted, as in containers),
``TCP_RX_SEG_SIZE``/``TCP_TX_SEG_SIZE`` of 512K (the default segment caps UCX's TCP at
about 1.1 GB/s; 512K lifts it to 4-6 GB/s) and ``MM_ERROR_HANDLING=y`` (above).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hmac
import logging
import secrets
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy

from ._device import is_device
from ._errors import PeerClosed
from ._pipes import Pipe, byte_views
from ._protocol import HEADER
from ._ucx_worker import Worker

_Worker = Worker  # the name benches/ use for raw ucxx baselines
_log = logging.getLogger("kvbridge.transfer")


PACK_BELOW_BYTES = 64 << 10
"""Payloads smaller than this travel packed with their neighbours (one message per run)."""

PACK_RUN_BYTES = 1 << 20
"""Most bytes packed into one message."""

CONNECT_BYTES = 4096
"""Fixed size of a CONNECT (a worker address is a few hundred bytes)."""

END_ROUNDS = 100
"""Worker progress rounds a closing pipe gives the messages it sent last (an ERROR answer,
then the end of stream) to go out before it cancels what is left: small messages go out
in the first round unless the peer's queue is full, and a peer that reads nothing learns
of the end from its keepalive. A closing pipe never waits longer on a big send it had
under way: it closes on an error, when the peer will not read the rest anyway."""

_NO_CHANNEL = 0xFFFFFFFF  # the listener's: CONNECTs travel on it
_CONNECT_TAG = _NO_CHANNEL << 32
_CONTROL = 1 << 31  # a pipe's own messages: ACCEPT, end of stream
_ACCEPT, _END = 0, 1
_SEQUENCE = _CONTROL - 1
_MAGIC = b"KVU1"
_CONNECT = struct.Struct("<4s16sIH")  # magic, connect key, channel, address length
_ACCEPTED = struct.Struct("<4sI")  # magic, channel
_END_AT = struct.Struct("<Q")  # end of stream: how many messages came before it
_HEADER_BYTES = HEADER.size


def ucx_available() -> bool:
    """True when the ucxx bindings import (``pip install 'kvbridge[ucx]'``)."""
    try:
        import ucxx._lib.libucxx  # noqa: F401, PLC0415
    except Exception:
        return False
    return True


def _pack(views: Sequence[Any]) -> bytes:
    """One message of small payloads; GPU views are copied to host memory first."""
    return b"".join(v.get() if is_device(v) else v for v in views)


def _unpack(staging: bytearray, views: Sequence[Any]) -> None:
    """Small payloads of one message into their views. A GPU view is written on cupy's
    default stream, whose copy from pageable memory may return before the bytes land,
    and which orders nothing against an engine's own streams: its device is synchronized
    before the receive is reported done."""
    offset, devices = 0, []
    for view in views:
        part = memoryview(staging)[offset : offset + view.nbytes]
        if is_device(view):
            view.set(numpy.frombuffer(part, numpy.uint8))
            devices.append(view.device)
        else:
            view[:] = part
        offset += view.nbytes
    for device in set(devices):
        device.synchronize()


def message_runs(lengths: Sequence[int]) -> list[tuple[int, int]]:
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


def _connect_message(key: bytes, channel: int, address: bytes) -> bytearray:
    message = bytearray(CONNECT_BYTES)
    _CONNECT.pack_into(message, 0, _MAGIC, key, channel, len(address))
    message[_CONNECT.size : _CONNECT.size + len(address)] = address
    return message


def _read_connect(message: bytes, key: bytes) -> tuple[int, bytes] | None:
    """The channel and worker address of a CONNECT made with ``key``; None for anything else."""
    magic, their_key, channel, length = _CONNECT.unpack_from(message)
    if magic != _MAGIC or not hmac.compare_digest(their_key, key):
        return None
    if channel == _NO_CHANNEL or not 0 < length <= CONNECT_BYTES - _CONNECT.size:
        return None
    return channel, message[_CONNECT.size : _CONNECT.size + length]


def _read_accepted(message: bytes) -> int:
    magic, channel = _ACCEPTED.unpack(message)
    if magic != _MAGIC or channel == _NO_CHANNEL:
        raise PeerClosed("the UCX listener answered with something else than ACCEPT")
    return int(channel)


def _tag(ucx: Any, channel: int, sequence: int) -> Any:
    return ucx.UCXXTag((channel << 32) | sequence)


class _Channels:
    """The channels a worker receives streams on: drawn at random among those free."""

    def __init__(self) -> None:
        self._taken: set[int] = set()
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            channel = secrets.randbelow(_NO_CHANNEL)
            while channel in self._taken:
                channel = (channel + 1) % _NO_CHANNEL
            self._taken.add(channel)
            return channel

    def release(self, channel: int) -> None:
        with self._lock:
            self._taken.discard(channel)


class UcxPipe:
    """One stream over a UCX endpoint: tagged messages on two channels, one chosen by each
    side for what it receives. Owns every request it posts: ``close`` cancels them all."""

    device_memory = True
    byte_stream = False

    def __init__(
        self,
        worker: _Worker,
        endpoint: Any,
        channels: tuple[int, int],
        release: Callable[[int], None],
    ) -> None:
        self._worker = worker
        self._endpoint: Any = endpoint  # None once closed (set on the worker thread)
        self._send_channel, self._recv_channel = channels
        self._release = release
        self._send_seq = 0
        self._recv_seq = 0
        self._timeout: float | None = None
        self._closed = False
        self._peer_ended = False
        self._end_at: int | None = None  # the peer ended after this many messages
        self._sends: deque[concurrent.futures.Future[Any]] = deque()
        self._sending: deque[list[Any]] = deque()  # requests of sends (worker thread only)
        self._posted = 0  # messages posted so far (worker thread only)
        self._end_box = bytearray(_END_AT.size)
        self._lock = threading.Lock()

    def start(self, *, accept: bool = False) -> None:
        """Wait for the peer's end of stream; the listener's side first answers ACCEPT."""
        ucx, array = self._worker.ucx, self._worker.Array
        if accept:
            answer = _ACCEPTED.pack(_MAGIC, self._recv_channel)
            self._post([answer], [_tag(ucx, self._send_channel, _CONTROL | _ACCEPT)])
        end_tag = _tag(ucx, self._recv_channel, _CONTROL | _END)

        def watch() -> Any:
            return [self._live_endpoint().tag_recv(array(self._end_box), end_tag)], None

        self._worker.call(watch).add_done_callback(self._ended)

    def _live_endpoint(self) -> Any:
        if self._endpoint is None:
            raise EOFError("the UCX pipe is closed")
        return self._endpoint

    def _ended(self, future: concurrent.futures.Future[Any]) -> None:
        """The end-of-stream watch settled (on the worker thread): the peer closed, or it
        failed (UCX noticed), or this side closed first (then there is nothing to do). As
        after a TCP FIN, what the peer sent before its end can still be received."""
        exc = future.exception()
        if self._endpoint is None or isinstance(exc, EOFError):
            return  # closed here, or the transport is closing
        unsent = any(not r.completed for sent in self._sending for r in sent)
        with self._lock:
            self._end_at = _END_AT.unpack(self._end_box)[0] if exc is None else 0
            beyond = self._recv_seq > self._end_at  # a receive waits for what never comes
        if beyond or unsent:  # (the peer will not take what is still on its way either)
            self._peer_ended = True
            self.close()

    def _tags(self, channel: int, first: int, count: int) -> list[Any]:
        ucx = self._worker.ucx
        return [_tag(ucx, channel, (first + i) & _SEQUENCE) for i in range(count)]

    def _numbers(self, count: int, *, send: bool) -> int:
        """The first of ``count`` sequence numbers in one direction."""
        with self._lock:
            if self._closed:
                raise EOFError("the UCX pipe is closed")
            if send:
                first, self._send_seq = self._send_seq, self._send_seq + count
                return first
            ended = self._end_at is not None and self._recv_seq + count > self._end_at
            if not ended:
                first, self._recv_seq = self._recv_seq, self._recv_seq + count
                return first
        self._peer_ended = True
        self.close()
        raise EOFError("the peer closed the stream")

    def send(
        self, buffers: Sequence[bytes | memoryview], ready: Callable[[int], None] | None = None
    ) -> None:
        if ready is not None:  # posted all at once
            ready(len(buffers))
        first, *views = byte_views(buffers)
        messages: list[Any] = [first[:_HEADER_BYTES]]
        if len(first) > _HEADER_BYTES:
            messages.append(first[_HEADER_BYTES:])
        borrowed = False  # a message is a caller's view, not a packed copy
        for start, end in message_runs([v.nbytes for v in views]):
            borrowed = borrowed or end - start == 1
            messages.append(views[start] if end - start == 1 else _pack(views[start:end]))
        seq = self._numbers(len(messages), send=True)
        tags = self._tags(self._send_channel, seq, len(messages))
        self._post(messages, tags, seq, borrowed=borrowed)

    def _post(
        self,
        messages: list[Any],
        tags: list[Any],
        seq: int | None = None,
        *,
        borrowed: bool = False,
    ) -> None:
        """Post sends (``seq``: the first message's sequence number; None for the pipe's own
        messages). They complete in the background, so that many frames are in flight (as
        over TCP, where sendall returns once the kernel has the bytes); the future's result
        keeps the messages alive until UCX is done with them. ``flush`` waits for those that
        read a caller's memory (``borrowed``); packed copies need no wait, and a frame of
        small payloads never holds up the next one. A failed send closes the pipe: the peer
        then sees the end."""
        array = self._worker.Array

        def post() -> Any:
            endpoint = self._live_endpoint()
            pairs = zip(messages, tags, strict=True)
            requests = [endpoint.tag_send(array(m), t) for m, t in pairs]
            sending = self._sending
            while sending and all(r.completed for r in sending[0]):
                sending.popleft()
            sending.append(requests)
            if seq is not None:
                self._posted = seq + len(messages)
            return requests, messages

        future = self._worker.call(post)
        future.add_done_callback(self._sent)
        while self._sends and self._sends[0].done():
            self._sends.popleft()
        if borrowed:
            self._sends.append(future)

    def _sent(self, future: concurrent.futures.Future[Any]) -> None:
        if future.exception() is not None:
            self.close()

    def flush(self) -> None:
        for future in list(self._sends):
            self._wait(future)

    def _receive(self, buffers: list[Any]) -> None:
        seq = self._numbers(len(buffers), send=False)
        tags = self._tags(self._recv_channel, seq, len(buffers))
        array = self._worker.Array

        def post() -> Any:
            endpoint = self._live_endpoint()
            pairs = zip(buffers, tags, strict=True)
            return [endpoint.tag_recv(array(b), t) for b, t in pairs], None

        self._wait(self._worker.call(post))

    def recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        self._receive([buf])
        return bytes(buf)

    def recv_into_views(
        self, views: Sequence[memoryview], landed: Callable[[int], None] | None = None
    ) -> None:
        targets: list[Any] = []
        unpack: list[tuple[bytearray, Sequence[memoryview]]] = []
        for start, end in message_runs([v.nbytes for v in views]):
            if end - start == 1:
                targets.append(views[start])
            else:
                staging = bytearray(sum(v.nbytes for v in views[start:end]))
                targets.append(staging)
                unpack.append((staging, views[start:end]))
        self._receive(targets)
        for staging, parts in unpack:
            _unpack(staging, parts)
        if landed is not None:  # messages land in any order: all at once
            landed(len(views))

    def discard(self, lengths: Sequence[int]) -> None:
        self._receive([bytearray(sum(lengths[s:e])) for s, e in message_runs(list(lengths))])

    def set_timeout(self, seconds: float | None) -> None:
        self._timeout = seconds

    def set_deadline(self, deadline: float | None) -> None:
        """UCX messages arrive whole (no trickling): each wait is bounded by what is left."""
        self._timeout = None if deadline is None else max(deadline - time.monotonic(), 1e-3)

    def _wait(self, future: concurrent.futures.Future[Any]) -> Any:
        """The future's result; on a timeout the pipe closes and the wait goes on until UCX
        has finished or cancelled the future's requests: only then may their buffers go."""
        try:
            return future.result(self._timeout)
        except concurrent.futures.TimeoutError:
            self.close()
            concurrent.futures.wait([future])
            raise TimeoutError("UCX operation timed out") from None
        except self._worker.ucx.UCXError as exc:
            reason = "the peer closed the stream" if self._peer_ended else f"UCX: {exc}"
            raise EOFError(reason) from exc

    def close(self) -> None:
        """Tell the peer, then cancel every request of the stream (see the module docstring).
        Waits (briefly) for the worker thread to have done it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._worker.run(self._shut)

    def _shut(self) -> None:  # on the worker thread
        endpoint, self._endpoint = self._endpoint, None
        if endpoint is None:
            return
        if not self._peer_ended:
            self._say_end(endpoint)
        self._sending.clear()
        with contextlib.suppress(Exception):
            endpoint.close_blocking()
        self._release(self._recv_channel)

    def _say_end(self, endpoint: Any) -> None:
        """Send the end of stream (how many messages came before it), and give it and the
        last sends a few progress rounds to go out."""
        tag = _tag(self._worker.ucx, self._send_channel, _CONTROL | _END)
        end_at = _END_AT.pack(self._posted)
        with contextlib.suppress(Exception):
            self._sending.append([endpoint.tag_send(self._worker.Array(end_at), tag)])
            for _ in range(END_ROUNDS):
                if all(r.completed for sent in self._sending for r in sent):
                    return
                self._worker.worker.progress()


class UcxTransport:
    """Pipes over UCX endpoints made from worker addresses."""

    name = "ucx"
    device_memory = True
    frame_bytes = 64 << 20
    """A receiver posts a frame's payload receives together; each 1 MiB rendezvous waits on
    wake-ups, so more of them in flight is what hides that: one stream with 16 MiB frames
    moved 0.95 GB/s over shared memory, with 64 MiB frames 2.24 GB/s."""

    def __init__(self, accept: Callable[[Pipe], None] | None) -> None:
        """``accept``: pipes peers open to this worker (``None``: it only dials, and no
        CONNECT is ever received)."""
        self._accept = accept
        self._worker = _Worker()
        self._key = secrets.token_bytes(16)
        self._channels = _Channels()
        self._inbox = bytearray(CONNECT_BYTES)
        self._pipes: weakref.WeakSet[UcxPipe] = weakref.WeakSet()
        self._closing = False
        if accept is not None:
            self._post_connect_recv()

    def address(self) -> dict[str, Any]:
        """The worker's address and the connect key a CONNECT must carry."""
        return {"worker": self._worker.address, "key": self._key}

    def posted(self) -> int:
        """UCX operations posted and not yet finished or cancelled, the listener's included."""
        return self._worker.posted()

    def _endpoint(self, address: bytes) -> Any:
        ucx = self._worker.ucx
        return ucx.UCXEndpoint.create_from_worker_address(
            self._worker.worker, ucx.UCXAddress.create_from_buffer(address), True
        )

    def open(self, address: dict[str, Any], timeout: float) -> Pipe:
        their_address, key = bytes(address["worker"]), bytes(address["key"])
        channel = self._channels.take()
        message = _connect_message(key, channel, self._worker.address)
        reply = bytearray(_ACCEPTED.size)
        ucx, array = self._worker.ucx, self._worker.Array
        box: list[Any] = []  # the endpoint: made, and if need be dropped, on the worker thread

        def connect() -> Any:
            endpoint = self._endpoint(their_address)
            box.append(endpoint)
            return [
                endpoint.tag_recv(array(reply), _tag(ucx, channel, _CONTROL | _ACCEPT)),
                endpoint.tag_send(array(message), ucx.UCXXTag(_CONNECT_TAG)),
            ], None

        future = self._worker.call(connect)
        try:
            future.result(timeout)
            their_channel = _read_accepted(bytes(reply))
        except Exception as exc:
            self._worker.run(lambda: _drop(box))
            concurrent.futures.wait([future])  # nothing writes into ``reply`` any more
            self._channels.release(channel)
            raise PeerClosed(f"cannot open a UCX stream: {exc}") from exc
        pipe = UcxPipe(self._worker, box[0], (their_channel, channel), self._channels.release)
        box.clear()
        pipe.start()
        self._pipes.add(pipe)
        return pipe

    def _post_connect_recv(self) -> None:
        inbox, array = self._inbox, self._worker.Array
        tag = self._worker.ucx.UCXXTag(_CONNECT_TAG)
        worker = self._worker.worker
        future = self._worker.call(lambda: ([worker.tag_recv(array(inbox), tag)], None))
        future.add_done_callback(self._on_connect)

    def _on_connect(self, future: concurrent.futures.Future[Any]) -> None:
        """A CONNECT came (on the worker thread): answer it with a pipe, or drop it."""
        message = bytes(self._inbox)
        if self._closing:
            return
        self._post_connect_recv()  # first: nothing a peer sends stops the listener
        if future.exception() is not None:
            return  # longer than a CONNECT (truncated): dropped
        connect = _read_connect(message, self._key)
        if connect is None:
            return
        their_channel, address = connect
        try:
            endpoint = self._endpoint(address)
        except Exception as exc:
            _log.debug("ucx: a CONNECT with an unusable address: %s", exc)
            return
        channel = self._channels.take()
        pipe = UcxPipe(self._worker, endpoint, (their_channel, channel), self._channels.release)
        pipe.start(accept=True)
        self._pipes.add(pipe)

        def hand_over() -> Any:  # after ACCEPT is posted: a pipe refused at once says END
            assert self._accept is not None  # a dial-only transport posts no CONNECT recv
            self._accept(pipe)
            return [], None

        self._worker.call(hand_over)

    def close(self) -> None:
        self._closing = True
        for pipe in list(self._pipes):
            pipe.close()
        self._worker.close()


def _drop(box: list[Any]) -> None:
    """Close the endpoint in ``box`` (cancelling its requests) and let go of it."""
    for endpoint in box:
        with contextlib.suppress(Exception):
            endpoint.close_blocking()
    box.clear()
