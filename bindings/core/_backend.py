"""Where a connector's blocks live: a cache server (``kvbridge serve``, or one the engine's
worker runs for itself, ``_embedded``), or a cluster of them (``_cluster_backend``).

A backend answers: how many leading keys are present (``lookup``), keep these from
eviction until loaded (``pin``/``unpin``), and move blocks between the engine's memory and
the store (``load``, ``save``): zero-copy batched ops between the registered memory and
the server's slots, one op per segment of a block (a vLLM page, an SGLang K or V half).
``get``/``put`` move blocks through buffers the engine hands over per call instead.
``start`` is where a call's first key sits in its chain (its block index in the prompt).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from ..._closing import Closing
from ...store import BlockKey, Lease, Lineage, StoreClient
from ...store.client import ClientPool
from ...transfer import DEFAULT_STREAMS
from ._device import Device
from ._moves import PageMoves, server_mover
from ._pages import PageLayout


class Backend(Protocol):
    def lookup(self, keys: Sequence[BlockKey]) -> int: ...

    def pin(self, keys: Sequence[BlockKey], start: int = 0) -> Lease | None:
        """A lease on the blocks, or ``None`` when one is gone already."""

    def unpin(self, hold: Lease) -> None: ...

    def attach(self, memory: PageLayout, device: Device) -> None:
        """The engine memory that ``load`` and ``save`` move blocks of (worker side), on
        ``device``."""

    def load(self, keys: Sequence[BlockKey], offsets: np.ndarray, start: int = 0) -> None:
        """Fill the blocks (``memory.offsets`` of them) with the stored ones; raises when
        any cannot be loaded."""

    def save(
        self,
        keys: Sequence[BlockKey],
        offsets: np.ndarray,
        start: int = 0,
        lineage: Sequence[Lineage] = (),
    ) -> int:
        """Store the blocks (keys already present are skipped); returns how many moved.
        ``lineage`` (one per key, or none): sent where the store keeps it."""

    def get(self, keys: Sequence[BlockKey], out: Sequence[Any], start: int = 0) -> None:
        """Fill one ``block_bytes`` buffer per key (a copying path, for engines that hand
        over buffers of their own); raises when any cannot be loaded."""

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Any], start: int = 0) -> int:
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
    A client whose call failed is replaced by the next call (``ClientPool``). Pages move as
    ``_moves`` says: directly where the client's transport takes the memory, else staged.
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
        block_tokens: int = 0,
        verify: bool = True,
    ) -> None:
        """``on_staged(nbytes)`` counts bytes copied through the staging buffer;
        ``block_tokens``: the token ids per block of the lineage saves send."""
        self._address = address
        self._moves = PageMoves(block_bytes, staging, staging_bytes, on_staged)
        self._pool = ClientPool(
            per_server=connections,
            block_bytes=block_bytes,
            namespace=namespace,
            secret=secret,
            tenant=tenant,
            timeout=timeout,
            streams=streams,
            transports=transports,
            block_tokens=block_tokens,
            verify=verify,
        )
        try:
            self._pool.connect(address)
        except BaseException:
            self._pool.close()
            raise

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        with self._lease() as client:
            return client.match_prefix(keys)

    def pin(self, keys: Sequence[BlockKey], start: int = 0) -> Lease | None:
        """On the pool's first client: a lease on the server belongs to its session."""
        with self._pool.lease(self._address, first=True) as (client, _):
            try:
                return client.pin(keys)  # all or nothing
            except LookupError:  # BlockNotFound: evicted since the lookup
                return None

    def unpin(self, hold: Lease) -> None:
        with self._pool.lease(self._address, first=True):  # its turn on the client
            hold.release()

    def attach(self, memory: PageLayout, device: Device) -> None:
        self._moves.attach(memory, device)
        self._pool.prepare(lambda client: self._moves.route(server_mover(client)))

    def load(self, keys: Sequence[BlockKey], offsets: np.ndarray, start: int = 0) -> None:
        with self._pool.lease(self._address) as (client, route):
            self._moves.load(server_mover(client), route, keys, offsets, start)

    def save(
        self,
        keys: Sequence[BlockKey],
        offsets: np.ndarray,
        start: int = 0,
        lineage: Sequence[Lineage] = (),
    ) -> int:
        with self._pool.lease(self._address) as (client, route):
            mover = server_mover(client)
            return self._moves.save(mover, route, keys, offsets, start, lineage=lineage)

    def get(self, keys: Sequence[BlockKey], out: Sequence[Any], start: int = 0) -> None:
        with self._lease() as client:
            client.get(keys, out)

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Any], start: int = 0) -> int:
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
