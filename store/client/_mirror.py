"""A local view of a namespace's keys, kept from the server's event stream
(``docs/EVENTS.md``): an engine's scheduler probes it instead of asking the server.

The mirror's thread subscribes with a ticket, waits for the stream's first message (the
server sends one as the subscription takes), reads a snapshot of the keys and applies the
messages numbered after it, in order. It starts over (a new snapshot, at most once a
second) when a number is missing, a heartbeat is ahead of what it applied, a message is
malformed or too large, or the stream falls silent (the server is gone or restarted, the
namespace left it): it never guesses. While it is not in step, :meth:`KeyMirror.leading`
answers ``None`` and the caller asks the server. A stale mirror costs a miss or a pin
that fails, never a wrong byte: the pin and the load decide.

Memory is bounded by the namespace's keys and the socket's queue (``RCVHWM`` messages of
at most ``MAX_MESSAGE_BYTES``: 64 MiB): a flood costs a resync, which drops whatever waits
(all of it older than the snapshot that follows), nothing more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Container, Sequence
from typing import Protocol

import zmq

from ..._closing import Closing
from .._errors import StoreError
from .._keys import BlockKey
from .._stream import KeySnapshot, MalformedEvent, Message, Subscription
from .._wire import BadRequest
from ._subscriber import EventSubscriber, SubscriptionLost

_log = logging.getLogger("kvbridge.mirror")

SILENCE_S = 3.0
"""No message (the server sends a heartbeat every second) for this long: start over."""
RESYNC_EVERY_S = 1.0
"""Snapshots are read at most this often (a flood of bad messages costs no more)."""
RETRY_S = 1.0
"""After a failure to reach the server, try again after this long."""
NO_EVENTS_RETRY_S = 60.0
"""A server that publishes no events is asked again this rarely."""


class Source(Protocol):
    """What the mirror asks of the server (a :class:`~kvbridge.store.StoreClient`)."""

    def subscription(self) -> Subscription: ...

    def snapshot(self) -> KeySnapshot: ...

    def close(self) -> None: ...


class _Resync(Exception):
    """The mirror is out of step: read a snapshot again."""


class _Restart(Exception):
    """The subscription is over: subscribe again."""


class _NoEvents(Exception):
    """The server refused a subscription: it publishes no events."""


class KeyMirror(Closing):
    """The keys of one namespace, as its event stream says (see the module's docstring)."""

    def __init__(
        self,
        connect: Callable[[], Source],
        *,
        silence: float = SILENCE_S,
        resync_every: float = RESYNC_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``connect`` makes the mirror's own client of the server (called again after a
        failure); the mirror closes it. ``silence``: how long a stream may send nothing
        before the mirror subscribes again; ``resync_every``: snapshots at most this often."""
        self._connect = connect
        self._silence = silence
        self._resync_every = resync_every
        self._clock = clock
        self._keys: set[BlockKey] = set()
        self._ready = False
        self._stop = threading.Event()
        self._synced = threading.Condition()
        self.resyncs = 0
        """Snapshots read since the start (the first included)."""
        self._last_sync = -resync_every
        self._told = False
        self._thread = threading.Thread(target=self._run, name="kvbridge-mirror", daemon=True)
        self._thread.start()

    # -- reading (any thread) --------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Whether the mirror is in step with the stream now."""
        return self._ready

    def leading(self, keys: Sequence[BlockKey]) -> int | None:
        """How many leading ``keys`` the namespace holds, or ``None`` while out of step."""
        if not self._ready:
            return None
        present = self._keys
        for i, key in enumerate(keys):
            if key not in present:
                return i
        return len(keys)

    def view(self) -> Container[BlockKey] | None:
        """The keys themselves (no copy: read ``key in view`` only), or ``None`` while out
        of step."""
        return self._keys if self._ready else None

    def keys(self) -> set[BlockKey] | None:
        """A copy of the keys, or ``None`` while out of step."""
        return set(self._keys) if self._ready else None

    def wait_ready(self, timeout: float) -> bool:
        with self._synced:
            return self._synced.wait_for(lambda: self._ready, timeout)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        source: Source | None = None
        while not self._stop.is_set():
            try:
                source = source or self._connect()
                self._follow(source)
            except _Restart as exc:
                _log.debug("mirror starts over: %s", exc)
            except _NoEvents as exc:  # the server publishes no events (yet)
                if not self._told:
                    _log.info("no mirror of the namespace's keys: %s", exc)
                    self._told = True
                _closed(source)
                source = None
                self._stop.wait(NO_EVENTS_RETRY_S)
            except (StoreError, ConnectionError, TimeoutError, OSError, zmq.ZMQError) as exc:
                _log.info("mirror out of step: %s: %s", type(exc).__name__, exc)
                self._stop.wait(RETRY_S)
                _closed(source)
                source = None
            except Exception:
                _log.exception("mirror failed")
                self._stop.wait(RETRY_S)
                _closed(source)
                source = None
            finally:
                self._ready = False
        _closed(source)

    def _follow(self, source: Source) -> None:
        """Subscribe, then keep in step until the stream says to start over."""
        try:
            sub = source.subscription()
        except BadRequest as exc:  # the server publishes no events (a refused page is not it)
            raise _NoEvents(str(exc)) from None
        with EventSubscriber(sub, self._clock) as stream:
            self._receive(stream)  # the stream took the subscription
            while not self._stop.is_set():
                try:
                    self._keep_in_step(source, stream)
                except _Resync as exc:
                    _log.debug("mirror resyncs: %s", exc)

    def _keep_in_step(self, source: Source, stream: EventSubscriber) -> None:
        wait = self._last_sync + self._resync_every - self._clock()
        if wait > 0 and self._stop.wait(wait):
            return
        self._last_sync = self._clock()
        self._ready = False
        stream.drain()  # what waits is older than the snapshot: it holds all of it
        snapshot = source.snapshot()
        self.resyncs += 1
        keys, last = set(snapshot.keys), snapshot.seq
        while not self._stop.is_set():
            if not self._ready and not stream.pending():
                self._publish(keys)  # nothing waits: as in step as the stream can tell
            message = self._receive(stream)
            if message.cleared:
                raise _Restart("the namespace left the server")
            if message.seq > last:  # news: it must be the next number, with changes
                if message.seq != last + 1 or not message.changes:
                    raise _Resync(f"message {message.seq} after {last}")
                _apply(keys, message)
                last = message.seq
            # else the snapshot holds it already (or a heartbeat says we are in step)

    def _publish(self, keys: set[BlockKey]) -> None:
        """In step: probes read ``keys`` from now on (the thread keeps changing it)."""
        self._keys = keys
        with self._synced:
            self._ready = True
            self._synced.notify_all()

    def _receive(self, stream: EventSubscriber) -> Message:
        deadline = self._clock() + self._silence
        while not self._stop.is_set():
            left = deadline - self._clock()
            if left <= 0:
                raise _Restart("the stream fell silent")
            try:
                message = stream.receive(min(left, 0.25))
            except SubscriptionLost as exc:
                raise _Restart(str(exc)) from None
            except MalformedEvent as exc:
                raise _Resync(f"a malformed message: {exc}") from None
            if message is not None:
                return message
        raise _Restart("stopped")


def _apply(keys: set[BlockKey], message: Message) -> None:
    for key, stored in message.changes:
        if stored:
            keys.add(key)
        else:
            keys.discard(key)


def _closed(source: Source | None) -> None:
    if source is not None:
        try:
            source.close()
        except Exception:
            _log.debug("closing the mirror's client failed", exc_info=True)
