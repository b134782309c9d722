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
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..._closing import Closing
from ...store import BlockKey, ClientPool, StoreClient
from ...transfer import DEFAULT_STREAMS, LocalProtocolError, Region, is_device
from ._pages import LayoutError, PageLayout
from ._staging import Stager, copier_for

_log = logging.getLogger("kvbridge.bindings")


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
    A client whose call failed is replaced by the next call (``ClientPool``).

    Pages move directly between the registered engine memory and the server's slots where
    the client's transport takes that memory (host memory always; GPU memory over UCX with
    CUDA), and through the staging buffer (``_staging``) otherwise, or always with
    ``staging="always"``.
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
        streams: int = DEFAULT_STREAMS,
        transports: str = "tcp",
        staging: str = "auto",
        staging_bytes: int = 256 << 20,
        on_staged: Callable[[int], None] = lambda nbytes: None,
    ) -> None:
        """``on_staged(nbytes)`` counts bytes copied through the staging buffer."""
        self._address = address
        self._block_bytes = block_bytes
        self._staging = staging
        self._staging_bytes = staging_bytes
        self._on_staged = on_staged
        self._memory: PageLayout | None = None
        self._stager: Stager | None = None
        self._pool = ClientPool(
            per_server=connections,
            block_bytes=block_bytes,
            namespace=namespace,
            secret=secret,
            tenant=tenant,
            timeout=timeout,
            streams=streams,
            transports=transports,
        )
        try:
            self._pool.connect(address)
        except BaseException:
            self._pool.close()
            raise

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        with self._lease() as client:
            return client.match_prefix(keys)

    def pin(self, keys: Sequence[BlockKey]) -> object | None:
        """One lease per request-sized chunk (a server bounds what one request pins)."""
        leases: list[int] = []
        with self._pool.lease(self._address, first=True) as (client, _):
            step = client.request_keys
            try:
                for start in range(0, len(keys), step):
                    leases.append(client.pin(keys[start : start + step]))
            except BaseException as exc:
                for lease in leases:  # all or nothing
                    client.release(lease)
                if isinstance(exc, LookupError):  # BlockNotFound: evicted since the lookup
                    return None
                raise
        return leases or None

    def unpin(self, hold: object) -> None:
        assert isinstance(hold, list)
        with self._pool.lease(self._address, first=True) as (client, _):
            for lease in hold:
                client.release(lease)

    def attach(self, memory: PageLayout) -> None:
        self._memory = memory
        self._pool.prepare(lambda client: self._route(memory, client))

    def load(self, keys: Sequence[BlockKey], offsets: np.ndarray) -> None:
        with self._pool.lease(self._address) as (client, route):
            if route.staging is None:
                client.get_pages(keys, route.attached(), offsets)
                return
            region, rows = route.staging, self._rows

            def fetch(start: int, count: int) -> None:
                client.get_into(keys[start : start + count], region, rows[:count].tolist())

            self._staged().load(self._attached(), offsets, fetch)

    def save(self, keys: Sequence[BlockKey], offsets: np.ndarray) -> int:
        with self._pool.lease(self._address) as (client, route):
            if route.staging is None:
                return sum(client.put_pages(keys, route.attached(), offsets))
            region, rows = route.staging, self._rows

            def send(start: int, count: int) -> int:
                return sum(
                    client.put_from(keys[start : start + count], region, rows[:count].tolist())
                )

            return self._staged().save(self._attached(), offsets, send)

    def get(self, keys: Sequence[BlockKey], out: Sequence[Any]) -> None:
        with self._lease() as client:
            client.get(keys, out)

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Any]) -> int:
        with self._lease() as client:
            return sum(client.put(keys, blocks))

    def clear(self) -> int:
        with self._lease() as client:
            return client.clear()

    def server_stats(self) -> dict[str, Any]:
        with self._lease() as client:
            return client.server_stats()

    def close(self) -> None:
        """Close every client, each once its call in flight ended (or its timeout passed)."""
        self._pool.close()

    @contextlib.contextmanager
    def _lease(self) -> Iterator[StoreClient]:
        with self._pool.lease(self._address) as (client, _):
            yield client

    def _route(self, memory: PageLayout, client: StoreClient) -> _Route:
        """How ``client`` moves ``memory``'s pages: registered as they are where its
        transport takes them (and ``staging`` is not ``"always"``), else staged."""
        gpu_over_tcp = is_device(memory.buffers[0]) and client.peer.transport != "ucx"
        if self._staging == "auto" and not gpu_over_tcp:
            try:
                registered = [client.register(buffer) for buffer in memory.buffers]
            except LocalProtocolError as exc:  # GPU memory this engine cannot register
                _log.info("kvbridge stages its pages: %s", exc)
            else:
                return _Route(regions=[registered[i] for i in memory.segment_buffer])
        return _Route(staging=client.register(self._staged().buffer))

    def _staged(self) -> Stager:
        if self._stager is None:
            self._stager = Stager(
                copier_for(self._attached()),
                self._staging_bytes,
                self._block_bytes,
                self._on_staged,
            )
        return self._stager

    def _attached(self) -> PageLayout:
        if self._memory is None:
            raise LayoutError("no engine memory attached")
        return self._memory

    @property
    def _rows(self) -> np.ndarray:
        """Where each staged row starts in the staging buffer."""
        return np.arange(self._staged().blocks, dtype=np.int64) * self._block_bytes


@dataclass(frozen=True)
class _Route:
    """One client's way to the engine's memory: its registered pages, or the staging
    buffer registered with it."""

    regions: list[Region] | None = None
    staging: Region | None = None

    def attached(self) -> list[Region]:
        if not self.regions:
            raise LayoutError("no engine memory attached")
        return self.regions
