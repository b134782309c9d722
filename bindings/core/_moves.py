"""How a backend moves the engine's pages to and from its store: straight from the
registered memory where the store connection takes it (host memory always; GPU memory over
UCX), else through the staging buffer (``_staging``), or always with ``staging="always"``.

The same for one server and for a cluster: the store connection is a :class:`Mover`
(``server_mover`` wraps a ``StoreClient``, ``cluster_mover`` a ``ClusterClient``), and
``start`` is where a call's first key sits in its chain (a cluster places a chain's first
blocks on more than one member; one server ignores it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ...store import BlockCorrupt, BlockKey, ClusterClient, Lineage, StoreClient
from ...transfer import LocalProtocolError, is_device
from ._device import Device
from ._pages import LayoutError, PageLayout
from ._staging import Stager

__all__ = ["Mover", "PageMoves", "Route", "cluster_mover", "server_mover"]

_log = logging.getLogger("kvbridge.bindings")


class Mover(Protocol):
    """A store connection's zero-copy moves (``StoreClient``'s, with a chain position)."""

    @property
    def takes_device_memory(self) -> bool: ...

    def register(self, buffer: Any) -> Any: ...

    def get_pages(
        self, keys: Sequence[BlockKey], regions: Sequence[Any], offsets: Any, start: int
    ) -> None: ...

    def put_pages(
        self,
        keys: Sequence[BlockKey],
        regions: Sequence[Any],
        offsets: Any,
        start: int,
        lineage: Sequence[Lineage],
    ) -> list[bool]: ...


@dataclass(frozen=True)
class Route:
    """One connection's way to the engine's memory: its registered pages, or the staging
    buffer registered with it."""

    regions: list[Any] | None = None
    staging: Any = None

    def attached(self) -> list[Any]:
        if not self.regions:
            raise LayoutError("no engine memory attached")
        return self.regions


class PageMoves:
    """The engine's memory (``attach``), the staging buffer (made on first need), and
    loads and saves of its pages through one connection's :class:`Route`."""

    def __init__(
        self,
        block_bytes: int,
        staging: str,
        staging_bytes: int,
        on_staged: Callable[[int], None],
    ) -> None:
        """``on_staged(nbytes)`` counts bytes copied through the staging buffer."""
        self._block_bytes = block_bytes
        self._staging = staging
        self._staging_bytes = staging_bytes
        self._on_staged = on_staged
        self._memory: PageLayout | None = None
        self._device: Device | None = None
        self._stager: Stager | None = None

    def attach(self, memory: PageLayout, device: Device) -> None:
        """The engine's memory, and its device (whose copier stages its pages)."""
        self._memory, self._device = memory, device

    def route(self, mover: Mover) -> Route:
        """How ``mover`` moves the attached memory's pages: registered as they are where
        it takes them (and ``staging`` is not ``"always"``), else staged."""
        memory = self._attached()
        gpu_not_taken = is_device(memory.buffers[0]) and not mover.takes_device_memory
        if self._staging == "auto" and not gpu_not_taken:
            try:
                registered = [mover.register(buffer) for buffer in memory.buffers]
            except LocalProtocolError as exc:  # GPU memory this engine cannot register
                _log.info("kvbridge stages its pages: %s", exc)
            else:
                return Route(regions=[registered[i] for i in memory.segment_buffer])
        return Route(staging=mover.register(self._staged().buffer))

    def load(
        self, mover: Mover, route: Route, keys: Sequence[BlockKey], offsets: np.ndarray, start: int
    ) -> None:
        if route.staging is None:
            mover.get_pages(keys, route.attached(), offsets, start)
            return
        staging, rows = [route.staging], self._rows

        def fetch(first: int, count: int) -> None:
            at = rows[:count, None]
            try:
                mover.get_pages(keys[first : first + count], staging, at, start + first)
            except BlockCorrupt as exc:  # the chunks before this one are in the memory
                raise BlockCorrupt(keys[first:], first) from exc

        self._staged().load(self._attached(), offsets, fetch)

    def save(
        self,
        mover: Mover,
        route: Route,
        keys: Sequence[BlockKey],
        offsets: np.ndarray,
        start: int,
        *,
        lineage: Sequence[Lineage] = (),
    ) -> int:
        if route.staging is None:
            return sum(mover.put_pages(keys, route.attached(), offsets, start, lineage))
        staging, rows = [route.staging], self._rows

        def send(first: int, count: int) -> int:
            at, end = rows[:count, None], first + count
            part = lineage[first:end]
            return sum(mover.put_pages(keys[first:end], staging, at, start + first, part))

        return self._staged().save(self._attached(), offsets, send)

    def _staged(self) -> Stager:
        if self._stager is None:
            assert self._device is not None, "staging before the memory was attached"
            self._stager = Stager(
                self._device.copier(),
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


_PageMove = Callable[[Sequence[BlockKey], Sequence[Any], Any, int], Any]
_PagePut = Callable[[Sequence[BlockKey], Sequence[Any], Any, int, Sequence[Lineage]], Any]


@dataclass(frozen=True)
class _Mover:
    """A connection's registration, and its page moves with the chain position bound in
    or dropped (one server has no use for it)."""

    client: StoreClient | ClusterClient
    get_pages: _PageMove
    put_pages: _PagePut

    @property
    def takes_device_memory(self) -> bool:
        return self.client.takes_device_memory

    def register(self, buffer: Any) -> Any:
        return self.client.register(buffer)


def server_mover(client: StoreClient) -> Mover:
    return _Mover(
        client,
        lambda keys, regions, offsets, start: client.get_pages(keys, regions, offsets),
        lambda keys, regions, offsets, start, lineage: client.put_pages(
            keys, regions, offsets, lineage=lineage or None
        ),
    )


def cluster_mover(client: ClusterClient) -> Mover:
    return _Mover(
        client,
        lambda keys, regions, at, start: client.get_pages(keys, regions, at, chain_start=start),
        lambda keys, regions, at, start, lineage: client.put_pages(
            keys, regions, at, chain_start=start
        ),
    )
