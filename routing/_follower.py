"""Publishers' KV events read into a ``PrefixIndex``: one thread, one SUB socket per source.

A source is a vLLM instance's own publisher (``--kv-events-config``), which *connects* to
an endpoint with a host (vLLM binds only a wildcard one, every interface): the follower
binds that endpoint and the instance connects to it. Or it is a relay of kvbridge's
shared tiers (``kvbridge events --publish``), which binds: the follower connects. Messages
are applied in order of their numbers; a number ahead of the next expected one is a gap,
repaired through the source's replay socket where it has one (vLLM's ``replay_endpoint``,
the relay's ``--replay``), else applied as it comes (the index then lacks what was lost
until the source tells of it again).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from kvbridge._closing import Closing

from ._index import PrefixIndex
from ._shape import END_SEQ

_log = logging.getLogger("kvbridge.routing")

MAX_BATCH_BYTES = 64 << 20
"""A batch larger than this is dropped (the socket refuses it): vLLM's largest are a step's
events, some MiB with long prompts."""
REPLAY_WAIT_MS = 2000


@dataclass(frozen=True)
class Source:
    """One publisher: its name (what ``PrefixIndex.matched`` answers by), the endpoint, and
    whether the follower binds it (vLLM connects) or connects to it (a relay binds)."""

    name: str
    endpoint: str
    bind: bool = False
    replay: str | None = None


class EventFollower(Closing):
    """Reads every source's events into ``index`` on a thread of its own (started here,
    joined by :meth:`close`); ``lock`` guards the index (readers take it too)."""

    def __init__(self, index: PrefixIndex, sources: list[Source], lock: threading.Lock) -> None:
        context: zmq.Context[Any] = zmq.Context.instance()
        self._index = index
        self._lock = lock
        self._stop = threading.Event()
        self._subs: dict[zmq.Socket[bytes], Source] = {}
        self._last: dict[str, int] = {}
        self.bound: dict[str, str] = {}
        """Per source the follower binds, the endpoint bound (a port 0 made a real one)."""
        try:
            for source in sources:
                sub: zmq.Socket[bytes] = context.socket(zmq.SUB)
                self._subs[sub] = source
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                if source.bind:
                    sub.bind(source.endpoint)
                    bound = sub.getsockopt(zmq.LAST_ENDPOINT)
                    self.bound[source.name] = bound.decode() if isinstance(bound, bytes) else ""
                else:
                    sub.connect(source.endpoint)
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="kvbridge-follower", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._close_sockets()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sub in self._subs:
            poller.register(sub, zmq.POLLIN)
        while not self._stop.is_set():
            for ready, _ in poller.poll(100):
                source = self._subs[ready]
                try:
                    self._read(ready, source)
                except Exception:  # a bug of ours: said with its traceback, never a silent end
                    _log.exception("kvbridge routing: a message of %s", source.name)

    def _read(self, sub: zmq.Socket[bytes], source: Source) -> None:
        frames = sub.recv_multipart(zmq.NOBLOCK)
        if len(frames) != 3 or len(frames[1]) != 8:
            return
        seq = int.from_bytes(frames[1], "big")
        last = self._last.get(source.name)
        if last is not None and seq > last + 1 and source.replay is not None:
            self._replay(source, last + 1)
        self._apply(source, seq, frames[2])  # one it had (a publisher's repeat) is dropped

    def _replay(self, source: Source, start: int) -> None:
        """What the source still holds from ``start`` on, through its replay socket."""
        assert source.replay is not None
        context: zmq.Context[Any] = zmq.Context.instance()
        dealer: zmq.Socket[bytes] = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
        try:
            dealer.connect(source.replay)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while dealer.poll(REPLAY_WAIT_MS):
                frames = dealer.recv_multipart()
                if len(frames) < 3 or frames[-2] == END_SEQ:
                    return
                self._apply(source, int.from_bytes(frames[-2], "big"), frames[-1])
            _log.warning("kvbridge routing: %s's replay did not end", source.name)
        finally:
            dealer.close()

    def _apply(self, source: Source, seq: int, payload: bytes) -> None:
        last = self._last.get(source.name)
        if last is not None and seq <= last:
            return
        self._last[source.name] = seq
        try:
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except (ValueError, msgpack.ExtraData) as exc:
            _log.warning(
                "kvbridge routing: %s sent a batch that is not msgpack: %s", source.name, exc
            )
            return
        events = batch[1] if isinstance(batch, list) and len(batch) >= 2 else None
        if isinstance(events, list):
            with self._lock:
                self._index.apply(source.name, events)

    def _close_sockets(self) -> None:
        for sub in self._subs:
            sub.close()
