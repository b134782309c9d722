"""Peer: one engine's connection to another, and the batches submitted through it."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import zmq

from ._control_client import ControlClient
from ._digests import Digests
from ._errors import LocalProtocolError, PeerClosed, StillInFlight, TransferError
from ._handle import TransferHandle
from ._metadata import EngineInfo
from ._nixl import NixlLink
from ._ops import FramePlan, check, normalize, plan
from ._protocol import MAX_CONTROL_BYTES
from ._regions import Region, RegionInfo, RegionTable
from ._sessions import Credentials
from ._settings import TransferSettings
from ._small import Rows, check_small, plan_small, small_rows
from ._streams import InitiatorStream, Pending
from ._watchdog import Watchdog

PROBE_S = 0.1
"""While a caller waits for a batch (:meth:`Peer.wait`), how often the peer's control
connection is looked at: a peer process that died drops it, which a UCX stream does not
report (TCP's does, at once)."""

GREETING_TRIES = 3
"""Times a data stream is opened before its peer counts as refusing it (see
:meth:`Peer._open_stream`)."""


@dataclass(frozen=True)
class EngineSide:
    """What a :class:`Peer` uses of the engine that made it: the seam between the two,
    named (a peer touches nothing else of the engine)."""

    name: str
    settings: TransferSettings
    secret: bytes | None
    principal: str
    context: zmq.Context[Any]
    regions: RegionTable
    watchdog: Watchdog
    check_open: Callable[[], None]
    """Raises ``EngineClosed`` once the engine is closed."""
    settled: Callable[[TransferHandle, str, list[Region]], None]
    """A batch is done or failed: release its local regions and count it."""


_REQUEST_IDS = itertools.count(1)  # 0 is the stream HELLO


_Notify = bytes | Callable[[], bytes]
"""A write's notification, or what makes it once the bytes are written."""


def _check_notify(notify: object) -> bytes:
    if not isinstance(notify, bytes) or len(notify) > MAX_CONTROL_BYTES:
        raise LocalProtocolError(f"notify must be bytes of at most {MAX_CONTROL_BYTES}")
    return notify


def _made(notify: _Notify) -> bytes:
    """A write's notification, made now if a function makes it (its failure fails the
    batch, not the stream's thread that calls it)."""
    if not callable(notify):
        return notify
    try:
        made = notify()
    except Exception as exc:
        raise LocalProtocolError(f"making the write's notification failed: {exc!r}") from exc
    return _check_notify(made)


def _after_header(landed: Callable[[int], None], count: int) -> None:
    landed(count - 1)


def _host_view(regions: RegionTable, region_id: int) -> memoryview | None:
    region = regions.get(region_id)
    return None if region.device else region.view


class _Batch:
    """Counts a batch's frames down to completion and turns errors into batch errors."""

    def __init__(
        self,
        peer: Peer,
        ops: Any,
        handle: TransferHandle,
        notify: _Notify | None,
        frames: int,
    ) -> None:
        self.peer = peer
        self.ops = ops  # as the caller gave them: normalised only to describe a failed op
        self.handle = handle
        self.notify = notify
        self.expired: TransferError | None = None  # the error it fails with, once overdue
        self._writes_left = frames
        self._lock = threading.Lock()

    def frame_done(self) -> None:
        send_notify = False
        if self.notify is not None:
            with self._lock:
                self._writes_left -= 1
                send_notify = self._writes_left == 0
        self.handle.part_done()
        if send_notify:
            self.peer._send_notify(self)

    def fail(self, error: TransferError) -> None:
        error = self.expired or error
        index = error.op_index
        if index is not None and 0 <= index < len(self.ops):
            op = normalize(self.ops)[index]
            error = type(error)(
                f"op {index} (local region {op['local_region']} +{op['local_offset']}, "
                f"remote region {op['remote_region']} +{op['remote_offset']}, "
                f"{op['length']} bytes): {error}",
                op_index=index,
                code=error.code,
            )
        self.handle.fail(error)


class Peer:
    """A connection to a remote engine: ``write``/``read`` batches of ops through it.

    ``regions`` is the peer's regions as of the last handshake or :meth:`refresh`.
    ``transport`` names the transport in use. After a failure (peer killed, timeout,
    protocol error) the peer is closed: :meth:`reconnect` or ``engine.connect`` again.
    """

    def __init__(self, engine: EngineSide, info: EngineInfo, transport: Any) -> None:
        self._engine = engine
        self._info = info
        self._transport = transport
        self.name = info.name
        self.transport: str = transport.name
        self.regions: dict[int, RegionInfo] = dict(info.regions)
        self._streams: list[InitiatorStream] = []
        self._calls: ControlClient | None = None
        self._calls_lock = threading.Lock()
        self._credentials: Credentials | None = None
        self._error: str | None = None
        self._next_stream = 0
        self._lock = threading.Lock()
        self._closing = 0  # threads closing streams of this peer right now
        self._all_closed = threading.Condition(self._lock)
        self._link: NixlLink | None = None
        """A one-sided transport's path to the peer (``nixl``): no streams then."""
        self._link_client: ControlClient | None = None
        """The control connection the link was made over, open while it lives: the peer's
        engine ends the session when it closes (the client closed, or its process died)."""
        self._connect()

    # -- connection --------------------------------------------------------------------

    def _connect(self) -> None:
        settings = self._engine.settings
        client = ControlClient(self._engine.context, self._info.control, settings.connect_timeout)
        kept = False  # a link keeps the client: its connection is the session's life
        try:
            engine = self._engine
            credentials, fresh = client.handshake(engine.name, engine.secret, engine.principal)
            info = EngineInfo.decode(fresh)  # a restarted peer listens on new data ports
            self.regions = dict(info.regions)
            if self.transport not in info.transports:
                raise PeerClosed(f"{info.name} no longer offers {self.transport}")
            self._info = info
            if getattr(self._transport, "one_sided", False):
                self._link_to(client, credentials)
                kept = True
                return
        finally:
            if not kept:
                client.close()
        address = info.transports[self.transport]
        streams: list[InitiatorStream] = []
        try:
            for index in range(settings.streams):
                streams.append(self._open_stream(address, index, credentials))
        except BaseException:
            for stream in streams:
                stream.close("connect failed")
            raise
        self._credentials = credentials
        for stream in streams:
            stream.start()
        with self._lock:
            self._streams = streams
            self._error = None

    def _link_to(self, client: ControlClient, credentials: Credentials) -> None:
        """Meet the peer's one-sided transport over the session's control requests."""
        lengths = {i: info.length for i, info in self.regions.items()}
        link = self._transport.link(partial(client.link, credentials), lengths)
        with self._lock:
            old, self._link = self._link, link
            old_client, self._link_client = self._link_client, client
            self._credentials = credentials
            self._error = None
        if old is not None:
            old.close()
        if old_client is not None:
            old_client.close()

    def _open_stream(self, address: Any, index: int, credentials: Credentials) -> InitiatorStream:
        """One greeted data stream. A stream the peer closes before answering its greeting
        is opened again (a fresh greeting each time), up to :data:`GREETING_TRIES` times:
        a burst of silent connections may push a new stream out before its greeting is
        read (``_served``), and a peer that refuses the greeting refuses every try."""
        timeout = self._engine.settings.connect_timeout
        for attempt in range(GREETING_TRIES):
            stream = InitiatorStream(self._transport.open(address, timeout), index, self._broken)
            try:
                stream.handshake(credentials.hello(index), timeout)
                return stream
            except PeerClosed:
                stream.close("greeting not answered")
                if attempt + 1 == GREETING_TRIES:
                    raise
        raise AssertionError("unreachable")

    def refresh(self) -> dict[int, RegionInfo]:
        """Fetch the peer's current regions over the control plane (a link's over its own
        connection: another one's end would end the session)."""
        with self._lock:
            link, kept = self._link, self._link_client
        client = kept or ControlClient(
            self._engine.context, self._info.control, self._engine.settings.connect_timeout
        )
        try:
            self.regions = dict(EngineInfo.decode(client.metadata(self._session())).regions)
            if link is not None:
                lengths = {i: info.length for i, info in self.regions.items()}
                self._transport.relink(link, partial(client.link, self._session()), lengths)
        finally:
            if client is not kept:
                client.close()
        return self.regions

    def call(self, body: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """Send an application request (a map of msgpack types) to the peer's request
        handler (:meth:`TransferEngine.set_request_handler`) and return its reply.
        Thread-safe; calls are answered one at a time. Raises :class:`PeerClosed` when no
        answer comes within ``timeout`` (default: the engine's transfer timeout)."""
        wait = self._engine.settings.timeout if timeout is None else timeout
        with self._calls_lock:
            if self._error is not None:
                raise PeerClosed(f"peer {self.name} is closed: {self._error}")
            calls = self._calls_client()
            calls.timeout = wait
            try:
                return calls.call(self._session(), body)
            except PeerClosed:
                self._drop_calls(broken=calls.lost)
                raise

    def wait(self, handle: TransferHandle, timeout: float) -> None:
        """``handle.wait(timeout)``, except that a peer whose process died meanwhile fails
        it at once: every :data:`PROBE_S` the control connection is looked at, and once it
        dropped, the peer closes (and the batch fails with ``PeerClosed``)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                handle.wait(min(left, PROBE_S))
                return
            except TimeoutError:
                if left <= PROBE_S:
                    raise
            self._probe()

    def _probe(self) -> None:
        """Close the peer if its control connection dropped since the last look (not
        while another thread calls: that call sees the failure itself). A drop is taken
        for the peer's death: a peer process that died drops it, and so, rarely, does a
        network blip the DEALER already recovered from; that costs one reconnect."""
        if not self._calls_lock.acquire(blocking=False):
            return
        try:
            if self._error is None and self._calls_client().connection_failed():
                self._drop_calls(broken=True)
        finally:
            self._calls_lock.release()

    def _calls_client(self) -> ControlClient:
        """The control client of calls and casts, made on first use (under
        ``_calls_lock``)."""
        if self._calls is None:
            wait = self._engine.settings.timeout
            self._calls = ControlClient(self._engine.context, self._info.control, wait)
        return self._calls

    def _drop_calls(self, *, broken: bool) -> None:
        """Close the control client (a late answer must not be taken for the next one);
        ``broken``: its connection dropped, so the peer's process is gone or was replaced,
        and the streams are closed too (what is in flight fails now)."""
        assert self._calls is not None
        self._calls.close()
        self._calls = None
        if broken:
            self._broken("the peer's control connection dropped")

    def cast(self, body: dict[str, Any]) -> None:
        """:meth:`call` without waiting for (or seeing) the answer: for requests whose
        outcome the caller does not need, such as giving back a lease."""
        with self._calls_lock:
            if self._error is not None:
                raise PeerClosed(f"peer {self.name} is closed: {self._error}")
            self._calls_client().cast(self._session(), body)

    def _session(self) -> Credentials:
        if self._credentials is None:
            raise PeerClosed(f"peer {self.name} has no session")
        return self._credentials

    def reconnect(self) -> None:
        """Close the streams (failing what is in flight) and connect afresh."""
        self.close()
        self._connect()

    @property
    def closed(self) -> bool:
        return self._error is not None

    def close(self, reason: str = "closed by the caller") -> None:
        """Close every stream and join their threads; pending batches fail."""
        with self._lock:
            if self._error is None:
                self._error = reason
        self._close_streams(reason)
        with self._calls_lock:
            if self._calls is not None:
                self._calls.close()
                self._calls = None
        with self._lock:
            link, self._link = self._link, None
            client, self._link_client = self._link_client, None
        if link is not None:
            link.fail_all(PeerClosed(f"peer {self.name} is closed: {reason}"))
            link.close()
        if client is not None:
            client.close()

    def _broken(self, reason: str) -> None:
        """A stream failed: the whole peer goes (a batch spans all its streams)."""
        with self._lock:
            if self._error is not None:
                return
            self._error = reason
            link = self._link
        if link is not None:
            link.fail_all(PeerClosed(f"peer {self.name} is closed: {reason}"))
        self._close_streams(reason)

    def _close_streams(self, reason: str) -> None:
        """Close every stream and join their threads (from a stream's own thread, close()
        skips joining itself), then fail what was pending on them: a batch spans streams,
        and its caller may reuse its memory once it failed, so no stream may still be
        moving its bytes then."""
        with self._lock:
            streams, self._streams = self._streams, []
            self._closing += 1
        try:
            for stream in streams:
                stream.shut(reason)
            for stream in streams:
                stream.fail_pending(reason)
        finally:
            with self._lock:
                self._closing -= 1
                self._all_closed.notify_all()

    # -- batches -----------------------------------------------------------------------

    def write(
        self,
        ops: Any,
        *,
        notify: bytes | Callable[[], bytes] | None = None,
        digests: Digests | None = None,
    ) -> TransferHandle:
        """Write local bytes into the peer's regions.

        ``ops``: a numpy ``OP_DTYPE`` array or a list of ``(local_region, local_offset,
        remote_region, remote_offset, length)``. Done means the peer acknowledged that
        every byte is in its memory; then ``notify`` (bytes, at most 64 KiB, or a function
        that makes them then) is delivered to the peer's ``notifications()``, and only then
        is the handle done. ``digests`` (:class:`Digests`): hashed as the bytes go, ready
        for ``notify``. A ``notify`` function runs on a stream's thread: it must not wait
        on this peer. Do not touch the source bytes until the handle is done."""
        if isinstance(notify, bytes):
            _check_notify(notify)
        elif notify is not None and not callable(notify):
            raise LocalProtocolError(f"notify must be bytes of at most {MAX_CONTROL_BYTES}")
        return self._submit(ops, "w", notify, digests)

    def read(self, ops: Any, *, digests: Digests | None = None) -> TransferHandle:
        """Read the peer's bytes into local regions; done when every byte has landed.
        ``digests``: see :class:`Digests` (hashed as the bytes land)."""
        return self._submit(ops, "r", None, digests)

    def _submit(
        self, ops: Any, access: str, notify: _Notify | None, digests: Digests | None
    ) -> TransferHandle:
        engine = self._engine
        engine.check_open()
        if digests is not None:
            ops = normalize(ops)
        if self._link is not None:
            return self._submit_one_sided(ops, access, notify, digests)
        local, frames = self._plan(ops, access)
        follow: list[Callable[[int], None] | None] = [None] * len(frames)
        if digests is not None:  # the batch is sound: bound to it
            digests.bind(ops, partial(_host_view, engine.regions))
            follow = digests.follow(frames, access)
        with self._lock:
            if self._error is not None:
                raise PeerClosed(f"peer {self.name} is closed: {self._error}")
            streams = self._streams
            first = self._next_stream
            self._next_stream += len(frames)
        nbytes = sum(frame.nbytes for frame in frames)
        engine.regions.acquire(local)
        handle = TransferHandle(
            nbytes,
            len(frames) + (1 if notify is not None else 0),
            on_settle=lambda settled: engine.settled(settled, access, local),
        )
        batch = _Batch(self, ops, handle, notify, len(frames))
        if handle.done:
            return handle
        if not frames:  # a notification alone
            self._send_notify(batch)
            return handle
        engine.watchdog.watch(
            engine.settings.timeout, lambda: handle.done, lambda: self._expired(batch)
        )
        for i, frame in enumerate(frames):
            stream = streams[(first + i) % len(streams)]
            self._send_frame(stream, frame, access, batch, follow[i])
        return handle

    def _submit_one_sided(
        self, ops: Any, access: str, notify: _Notify | None, digests: Digests | None
    ) -> TransferHandle:
        """The batch as NIXL transfers (checked here: the target checks nothing). A small
        batch stays plain integers from the caller's list to NIXL's index lists. The
        notification goes with the batch: made now, with the digests of a write."""
        engine = self._engine
        rows = small_rows(ops)
        batch: Rows | np.ndarray
        if rows is not None:
            batch = rows
            local = check_small(rows, engine.regions, self.regions, access, device_ok=True)
            nbytes = sum(row[4] for row in rows)
        else:
            batch = normalize(ops)
            local = check(batch, engine.regions, self.regions, access, device_ok=True)
            nbytes = int(batch["length"].sum())
        if digests is not None:
            digests.bind(ops, partial(_host_view, engine.regions))  # normalised by _submit
        if notify is not None:
            notify = _made(notify)
        with self._lock:
            link = self._link
            if self._error is not None or link is None:
                raise PeerClosed(f"peer {self.name} is closed: {self._error}")
        parts = 1 if len(batch) or notify is not None else 0
        engine.regions.acquire(local)
        handle = TransferHandle(
            nbytes,
            parts,
            on_settle=lambda settled: engine.settled(
                settled, access, [] if isinstance(settled.error, StillInFlight) else local
            ),
            progress=link.progress,
        )
        if handle.done:
            return handle
        token = link.submit(batch, {r.id: r for r in local}, access, notify, handle)
        if token is None:  # moved when posted (shared memory): no deadline to watch
            return handle
        timeout = engine.settings.timeout
        engine.watchdog.watch(
            timeout,
            lambda: handle.done,
            lambda: link.expire(token, TransferError(f"not done after {timeout} s")),
        )
        return handle

    def _plan(self, ops: Any, access: str) -> tuple[list[Region], list[FramePlan]]:
        """Check the batch and plan its frames (a small one on the scalar fast path)."""
        engine = self._engine
        device_ok = self._transport.device_memory
        rows = small_rows(ops)
        if rows is not None:
            small = plan_small(
                rows,
                engine.regions,
                self.regions,
                access,
                device_ok=device_ok,
                slice_bytes=engine.settings.slice_bytes,
            )
            if small is not None:
                return small
        batch_ops = normalize(ops)
        local = check(batch_ops, engine.regions, self.regions, access, device_ok=device_ok)
        frames = plan(
            batch_ops,
            engine.regions,
            self.regions,
            slice_bytes=engine.settings.slice_bytes,
            frame_bytes=max(engine.settings.frame_bytes, self._transport.frame_bytes),
            streams=engine.settings.streams,
        )
        return local, frames

    def _send_frame(
        self,
        stream: InitiatorStream,
        frame: FramePlan,
        access: str,
        batch: _Batch,
        landed: Callable[[int], None] | None,
    ) -> None:
        request_id = next(_REQUEST_IDS)
        origin = frame.origin
        pending = Pending(
            on_done=batch.frame_done,
            on_error=batch.fail,
            describe=lambda i: int(origin[i]) if i is not None and 0 <= i < len(origin) else None,
        )
        try:
            views = frame.views  # cut now: after the batch's regions were acquired
        except ValueError as exc:  # one was unregistered between the check and the acquire
            batch.fail(LocalProtocolError(f"a local region of the batch is gone: {exc}"))
            return
        ready = None
        if access == "w":
            message: list[bytes | memoryview] = [
                stream.conn.write(request_id, frame.descriptors),
                *views,
            ]
            if landed is not None:  # hashed as they go: the header is the message's first
                ready = partial(_after_header, landed)
        else:
            message = [stream.conn.read(request_id, frame.descriptors)]
            pending.views, pending.landed = views, landed
        try:
            stream.submit(request_id, message, pending, frame.nbytes, ready)
        except TransferError as exc:
            batch.fail(exc)

    def _send_notify(self, batch: _Batch) -> None:
        assert batch.notify is not None
        with self._lock:
            streams = self._streams
        if not streams:
            batch.fail(PeerClosed(f"peer {self.name} is closed: {self._error}"))
            return
        stream = streams[0]
        request_id = next(_REQUEST_IDS)
        pending = Pending(on_done=batch.handle.part_done, on_error=batch.fail)
        try:
            message = _made(batch.notify)
            stream.submit(request_id, [stream.conn.notify(request_id, message)], pending, 0)
        except TransferError as exc:
            batch.fail(exc)

    def _expired(self, batch: _Batch) -> None:
        """Close the streams first, then fail: once the caller sees the failure, no byte of
        the batch may still land in (or be read from) its memory."""
        timeout = self._engine.settings.timeout
        batch.expired = TransferError(
            f"not done after {timeout} s; closed the streams to {self.name}"
        )
        self._broken(f"a transfer timed out after {timeout} s")
        with self._lock:  # another thread may be closing them: wait until it is done
            self._all_closed.wait_for(lambda: self._closing == 0)
        batch.fail(batch.expired)

    def __repr__(self) -> str:
        state = f"closed: {self._error}" if self._error else f"{len(self._streams)} streams"
        return f"Peer({self.name!r}, transport={self.transport!r}, {state})"
