"""A namespace's stream republished for KV-aware routers (``kvbridge events --publish``).

The relay holds the namespace's ticket like any subscriber (the server's access model is
unchanged), reads its stream in step (a snapshot, then the messages numbered after it),
and tells the routers in their shape (``_shape``) on a PUB socket of its own, with a
replay ROUTER that answers a router's ``[b"", start_seq]`` with every
message it still holds from ``start_seq`` on and an end marker, as vLLM's publisher does.

It never guesses. A missing number, a heartbeat ahead of what it applied, a malformed
message: it reads a snapshot and publishes the difference (``Published.resync``) before
anything that came after. A stream that falls silent (the server restarted, the namespace
left it) or ends (``AllBlocksCleared``): it subscribes again, and the new stream's snapshot
is diffed against what the routers were told: the blocks that left are removed from them,
one by one; never ``AllBlocksCleared``, which would wipe what other publishers told a
router about the same instance.

Messages are numbered from the microsecond the relay started (a router such as Dynamo's
drops a number at or below the last it applied: a restarted relay's must be higher), one
more each. A relay of its own stream (a router instance or topic of its own: the default)
starts with ``AllBlocksCleared``: whatever a predecessor told the router is void, and the
snapshot that follows is the whole truth. On a ``shared`` stream (another publisher's
topic, such as an llm-d pod's, whose GPU blocks a clear would wipe) it never sends one: a
relay restarted there cannot take back what its predecessor said, so give each relay's run
a new instance id or topic (``docs/EVENTS.md``).

One thread (started here, joined by :meth:`Relay.close`) owns both sockets and the
subscription.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from kvbridge._closing import Closing
from kvbridge.store import (
    TOKEN_BYTES,
    BlockKey,
    EventSubscriber,
    KeySnapshot,
    Lineage,
    MalformedEvent,
    Message,
    StoreError,
    Subscription,
    SubscriptionLost,
    TooManyRequests,
)
from kvbridge.transfer import TransferError

from ._published import Published
from ._shape import END_SEQ, Shape, pack

_log = logging.getLogger("kvbridge.relay")

SILENCE_S = 3.0
"""No message (the server sends a heartbeat a second) for this long: subscribe again."""
RETRY_S = 1.0
"""After a failure to reach the server, or a snapshot refused for its rate, wait this long."""
HISTORY_BYTES = 64 << 20
"""Republished messages kept for replays, in bytes of their batches at most."""
POLL_S = 0.05
"""How long a read waits before the relay looks at its replay socket again."""
HEARTBEAT_S = 1.0
"""Idle this long, the relay sends its last message again, numbered as it was: a router
that has it drops it by its number (Dynamo) or applies it again, which changes nothing;
one that subscribed since learns of what it missed (the number is ahead of what it
expects) and asks for a replay within a second."""


class Source(Protocol):
    """What the relay asks of the server (a :class:`~kvbridge.store.StoreClient` opened
    with the namespace's ``block_tokens``)."""

    block_tokens: int

    def subscription(self) -> Subscription: ...

    def snapshot(self, *, lineage: bool = False) -> KeySnapshot: ...

    def close(self) -> None: ...


@dataclass
class RelayStats:
    """What the relay did since it started (read by its owner; written by its thread)."""

    messages_in: int = 0
    keys_in: int = 0
    messages_out: int = 0
    keys_out: int = 0
    resyncs: int = 0
    replays: int = 0
    untokened: int = 0
    """Blocks heard of without token ids: never published (a router could not index them)."""
    lag_s: float = 0.0
    """The last republished message's age: its server timestamp to its send."""


class _Resync(Exception):
    """Out of step: read a snapshot."""


class Relay(Closing):
    """Republishes one namespace's stream for routers (see the module's docstring)."""

    def __init__(
        self,
        connect: Callable[[], Source],
        *,
        publish: str,
        topic: bytes,
        replay: str | None = None,
        shape: Shape | None = None,
        shared: bool = False,
        history_bytes: int = HISTORY_BYTES,
    ) -> None:
        """Binds ``publish`` (and ``replay``) now: a bad endpoint raises here. ``connect``
        makes the relay's client of the server (again after a failure)."""
        context: zmq.Context[Any] = zmq.Context.instance()
        self._connect = connect
        self._topic = topic
        self._shape = shape or Shape()
        self._history: collections.deque[tuple[int, bytes]] = collections.deque()
        self._history_bytes = history_bytes
        self._held = 0
        self._seq = itertools.count(time.time_ns() // 1000)
        self._sent = time.monotonic()
        self._shared = shared
        self._stop = threading.Event()
        self.stats = RelayStats()
        self._published: Published | None = None
        self._pub: zmq.Socket[bytes] = context.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.bind(publish)
            self.endpoint = _last(self._pub)
            self.replay_endpoint: str | None = None
            if replay is not None:
                self._replay = context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._replay.setsockopt(zmq.MAXMSGSIZE, 64)  # [id, b"", seq]: nothing more
                self._replay.bind(replay)
                self.replay_endpoint = _last(self._replay)
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kvbridge-relay", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._close_sockets()

    @property
    def blocks(self) -> int:
        """Blocks the routers were told the namespace holds."""
        return 0 if self._published is None else len(self._published)

    # -- the relay's thread ---------------------------------------------------------------

    def _run(self) -> None:
        if not self._shared:  # a predecessor's word is void: the snapshot is the truth
            self._publish([self._shape.cleared()], time.time())
        while not self._stop.is_set():
            try:
                client = self._connect()
            except (StoreError, TransferError, OSError) as exc:
                _log.warning("kvbridge relay: cannot reach the server (%s): trying again", exc)
                self._wait(RETRY_S)
                continue
            try:
                self._follow(client)
            except (StoreError, TransferError, OSError) as exc:
                _log.warning("kvbridge relay: the server failed (%s): subscribing again", exc)
                self._wait(RETRY_S)
            except Exception:  # a bug of ours: said with its traceback, never a silent end
                _log.exception("kvbridge relay: failed: subscribing again")
                self._wait(RETRY_S)
            finally:
                client.close()

    def _follow(self, client: Source) -> None:
        """One subscription, until it ends, falls silent or the relay closes."""
        if self._published is None:
            self._published = Published(self._shape, client.block_tokens)
        with EventSubscriber(client.subscription()) as stream:
            applied: int | None = None
            heard = time.monotonic()
            while not self._stop.is_set():
                self._answer_replays()
                self._heartbeat()
                try:
                    message = stream.receive(POLL_S)
                except SubscriptionLost:
                    return
                except MalformedEvent as exc:
                    _log.warning("kvbridge relay: %s: resynchronising", exc)
                    applied = None
                    continue
                if message is None:
                    if time.monotonic() - heard > SILENCE_S:
                        return  # the server restarted, or the namespace left it
                    continue
                heard = time.monotonic()
                applied = self._take(client, message, applied)
                if message.cleared:
                    self._resync(KeySnapshot(0, []))  # the namespace left: all of it went
                    return

    def _take(self, client: Source, message: Message, applied: int | None) -> int | None:
        """Apply ``message`` in step (a snapshot first where out of step); what is applied."""
        news = bool(message.events)
        try:
            if applied is None or message.seq > applied + (1 if news else 0):
                applied = self._snapshot(client)
            if not news or message.seq <= applied:
                return applied
            self._apply(message)
            return message.seq
        except _Resync as exc:
            _log.warning("kvbridge relay: %s: resynchronising", exc)
            return None

    def _snapshot(self, client: Source) -> int:
        """Read a snapshot (waiting out the server's rate), publish the difference."""
        while True:
            try:
                snapshot = client.snapshot(lineage=True)
                break
            except TooManyRequests:
                if self._wait(RETRY_S):
                    raise _Resync("closing") from None
        self._resync(snapshot)
        return snapshot.seq

    def _resync(self, snapshot: KeySnapshot) -> None:
        assert self._published is not None
        self.stats.resyncs += 1
        self._published.resync(snapshot)
        self._send(time.time())

    def _apply(self, message: Message) -> None:
        published = self._published
        assert published is not None
        self.stats.messages_in += 1
        for event in message.events:
            for key, medium, lineage in _changes(event):
                self.stats.keys_in += 1
                if medium is None:
                    published.removed(key)
                else:
                    published.stored(key, medium, lineage)
        self._send(message.ts)

    def _send(self, ts: float) -> None:
        assert self._published is not None
        self.stats.untokened = self._published.untokened
        for events in self._published.take():
            if events:
                self._publish(events, ts)

    def _publish(self, events: list[object], ts: float) -> None:
        seq = next(self._seq)
        payload = pack(events, ts)
        self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
        self._sent = time.monotonic()
        self._remember(seq, payload)
        self.stats.messages_out += 1
        self.stats.keys_out += sum(_keys_of(event) for event in events)
        self.stats.lag_s = max(0.0, time.time() - ts)

    def _heartbeat(self) -> None:
        if not self._history or time.monotonic() - self._sent < HEARTBEAT_S:
            return
        seq, payload = self._history[-1]
        self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
        self._sent = time.monotonic()

    def _remember(self, seq: int, payload: bytes) -> None:
        self._history.append((seq, payload))
        self._held += len(payload)
        while self._held > self._history_bytes and len(self._history) > 1:
            self._held -= len(self._history.popleft()[1])

    def _answer_replays(self) -> None:
        """Every waiting ``[id, b"", start_seq]``: the messages held from ``start_seq`` on,
        then the end marker. A router that does not read its replay loses it (no wait)."""
        socket = self._replay
        while socket is not None and socket.poll(0):
            frames = socket.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3 or len(frames[2]) != 8:
                continue
            peer, start = frames[0], int.from_bytes(frames[2], "big")
            self.stats.replays += 1
            try:
                for seq, payload in list(self._history):
                    if seq >= start:
                        socket.send_multipart(
                            [peer, b"", self._topic, seq.to_bytes(8, "big"), payload],
                            zmq.NOBLOCK,
                        )
                socket.send_multipart([peer, b"", b"", END_SEQ, b""], zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # full, or gone: its replay is lost, not ours
                _log.warning("kvbridge relay: a replay was not taken (%s)", exc)

    def _wait(self, seconds: float) -> bool:
        """Sleep unless closing; whether the relay is closing."""
        return self._stop.wait(seconds)

    def _close_sockets(self) -> None:
        self._pub.close()
        if self._replay is not None:
            self._replay.close()


_Change = tuple[BlockKey, str | None, Lineage | None]


def _changes(event: dict[str, object]) -> list[_Change]:
    """One kvbridge event as (key, medium or None when removed, lineage) per key;
    :class:`_Resync` for fields that do not fit together."""
    if event["type"] == "AllBlocksCleared":
        return []  # the message says so (``Message.cleared``): the stream ends after it
    hashes = event["block_hashes"]
    assert isinstance(hashes, list)  # the stream's decoder checked the keys
    if event["type"] != "BlockStored":
        return [(BlockKey(key), None, None) for key in hashes]
    medium = event.get("medium")
    tokens, size, parent = (
        event.get("token_ids"),
        event.get("block_size"),
        event.get("parent_block_hash"),
    )
    if not isinstance(medium, str) or not isinstance(tokens, list) or not isinstance(size, int):
        raise _Resync("a BlockStored without its medium, token ids or block size")
    if not size or not tokens:
        return [(BlockKey(key), medium, None) for key in hashes]
    if len(tokens) != size * len(hashes) or not (parent is None or isinstance(parent, bytes)):
        raise _Resync("a BlockStored whose token ids do not cover its blocks")
    try:  # checked once for the event, then cut a block at a time
        ids = Lineage.of(None, tokens).tokens
    except ValueError as exc:
        raise _Resync(f"a BlockStored with bad token ids ({exc})") from None
    step = size * TOKEN_BYTES
    parents = [parent, *hashes[:-1]]
    return [
        (
            BlockKey(key),
            medium,
            Lineage(None if up is None else BlockKey(up), ids[n * step : (n + 1) * step]),
        )
        for n, (key, up) in enumerate(zip(hashes, parents, strict=True))
    ]


def _keys_of(event: object) -> int:
    if isinstance(event, list):
        return len(event[1]) if len(event) > 1 else 0
    assert isinstance(event, dict)
    return len(event.get("block_hashes", ()))


def _last(socket: zmq.Socket[bytes]) -> str:
    endpoint = socket.getsockopt(zmq.LAST_ENDPOINT)
    return endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
