"""Where a connector's blocks live: a cache server (``kvbridge serve``, or one the engine's
worker runs for itself, ``_embedded``).

A backend answers: how many leading keys are present (``lookup``), keep these from
eviction until loaded (``pin``/``unpin``), and move blocks between the engine's memory and
the store (``load``, ``save``): zero-copy batched ops between the registered memory and
the server's slots, one op per segment of a block (a vLLM page, an SGLang K or V half).
``get``/``put`` move blocks through buffers the engine hands over per call instead.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from ..._closing import Closing
from ...store import BlockKey, StoreClient
from ...transfer import Region
from ._pages import LayoutError, PageLayout


class Backend(Protocol):
    def lookup(self, keys: Sequence[BlockKey]) -> int: ...

    def pin(self, keys: Sequence[BlockKey]) -> object | None:
        """A hold on the blocks, or ``None`` when one is gone already."""

    def unpin(self, hold: object) -> None: ...

    def attach(self, memory: PageLayout) -> None:
        """The engine memory that ``load`` and ``save`` move blocks of (worker side)."""

    def load(self, keys: Sequence[BlockKey], offsets: np.ndarray) -> None:
        """Fill the blocks (``memory.offsets`` of them) with the stored ones; raises when
        any cannot be loaded."""

    def save(self, keys: Sequence[BlockKey], offsets: np.ndarray) -> int:
        """Store the blocks (keys already present are skipped); returns how many moved."""

    def get(self, keys: Sequence[BlockKey], out: Sequence[Any]) -> None:
        """Fill one ``block_bytes`` buffer per key (a copying path, for engines that hand
        over buffers of their own); raises when any cannot be loaded."""

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Any]) -> int:
        """Store one ``block_bytes`` buffer per key; returns how many moved."""

    def clear(self) -> int:
        """Remove every block of the namespace no reader holds; returns how many."""

    def close(self) -> None: ...


class ServerBackend(Closing):
    """Blocks in a cache server, one namespace per model layout.

    Every call takes at most ``timeout`` in all (a call of many blocks makes several
    requests). ``connections`` clients (each its own control channel and streams) let that
    many threads call at once: an engine whose lookups must not wait behind a large save (SGLang
    looks up, loads and saves on three threads) asks for more than one. Pins use the first.
    """

    def __init__(
        self,
        address: str,
        secret: bytes | None,
        namespace: bytes,
        block_bytes: int,
        timeout: float,
        *,
        connections: int = 1,
        tenant: str = "",
    ) -> None:
        self._lanes: list[_Lane] = []
        self._timeout = timeout
        try:
            for _ in range(connections):
                client = StoreClient(
                    address,
                    block_bytes=block_bytes,
                    namespace=namespace,
                    secret=secret,
                    tenant=tenant,
                    timeout=timeout,
                )
                self._lanes.append(_Lane(client))
        except BaseException:
            self.close()
            raise
        self._turn = itertools.count()

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        with self._lane() as lane:
            return lane.client.match_prefix(keys)

    def pin(self, keys: Sequence[BlockKey]) -> object | None:
        """One lease per request-sized chunk (a server bounds what one request pins)."""
        leases: list[int] = []
        lane = self._lanes[0]  # a lease belongs to the session that took it
        with lane.lock, lane.client.deadline(self._timeout):
            step = lane.client.request_keys
            try:
                for start in range(0, len(keys), step):
                    leases.append(lane.client.pin(keys[start : start + step]))
            except BaseException as exc:
                for lease in leases:  # all or nothing
                    lane.client.release(lease)
                if isinstance(exc, LookupError):  # BlockNotFound: evicted since the lookup
                    return None
                raise
        return leases or None

    def unpin(self, hold: object) -> None:
        assert isinstance(hold, list)
        lane = self._lanes[0]
        with lane.lock, lane.client.deadline(self._timeout):
            for lease in hold:
                lane.client.release(lease)

    def attach(self, memory: PageLayout) -> None:
        for lane in self._lanes:
            with lane.lock:
                registered = [lane.client.register(buffer) for buffer in memory.buffers]
                lane.regions = [registered[i] for i in memory.segment_buffer]

    def load(self, keys: Sequence[BlockKey], offsets: np.ndarray) -> None:
        with self._lane() as lane:
            lane.client.get_pages(keys, lane.attached(), offsets)

    def save(self, keys: Sequence[BlockKey], offsets: np.ndarray) -> int:
        with self._lane() as lane:
            return sum(lane.client.put_pages(keys, lane.attached(), offsets))

    def get(self, keys: Sequence[BlockKey], out: Sequence[Any]) -> None:
        with self._lane() as lane:
            lane.client.get(keys, out)

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Any]) -> int:
        with self._lane() as lane:
            return sum(lane.client.put(keys, blocks))

    def clear(self) -> int:
        with self._lane() as lane:
            return lane.client.clear()

    def server_stats(self) -> dict[str, Any]:
        with self._lane() as lane:
            return lane.client.server_stats()

    def close(self) -> None:
        """Close every client, each once its call in flight ended (or its timeout passed)."""
        for lane in self._lanes:
            held = lane.lock.acquire(timeout=self._timeout)
            try:
                lane.client.close()
            finally:
                if held:
                    lane.lock.release()

    @contextlib.contextmanager
    def _lane(self) -> Iterator[_Lane]:
        """A free client if there is one, else wait for one (taken in turn)."""
        for lane in self._lanes:
            if lane.lock.acquire(blocking=False):
                break
        else:
            lane = self._lanes[next(self._turn) % len(self._lanes)]
            lane.lock.acquire()
        try:
            with lane.client.deadline(self._timeout):  # one call, one timeout in all
                yield lane
        finally:
            lane.lock.release()


class _Lane:
    """One client and the engine memory registered with it; one call at a time."""

    def __init__(self, client: StoreClient) -> None:
        self.client = client
        self.lock = threading.Lock()
        self.regions: list[Region] = []

    def attached(self) -> list[Region]:
        if not self.regions:
            raise LayoutError("no engine memory attached")
        return self.regions
