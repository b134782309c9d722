"""A connector's blocks in a cluster of cache servers found in etcd (``server:
"etcd://HOST:PORT[,HOST:PORT...]"``): a :class:`~kvbridge.store.ClusterClient`, whose
calls go to the members that own each key, in parallel, zero-copy (the engine's memory is
registered once with each member's connection, on its first use there). Lookups ask every
key's members at once; a pin is a lease on each member that holds some of the blocks; a
chain's first blocks live on two members and load from whichever answers.

A member that dies is noticed by the call that meets it (its connection drops) and left
out: its blocks are misses, never errors. An etcd that cannot be reached when the
connector starts is a store that is down (``ConnectionError``: the connector warns and
tries again after its pause); a cluster with no members yet answers misses and stores
nothing until one joins.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..._closing import Closing
from ...store import BlockKey, BlockNotFound, ClusterClient, Lease, Lineage
from ._device import Device
from ._moves import PageMoves, Route, cluster_mover
from ._pages import LayoutError, PageLayout

__all__ = ["ClusterBackend"]

_log = logging.getLogger("kvbridge.bindings")


class ClusterBackend(Closing):
    """Blocks in a cluster, one namespace per model layout (``ServerBackend``'s settings;
    ``connections`` clients per member)."""

    def __init__(
        self,
        url: str,
        secret: bytes | None,
        namespace: bytes,
        block_bytes: int,
        timeout: float,
        *,
        cluster: str,
        connections: int = 1,
        tenant: str = "",
        streams: int,
        transports: str = "tcp",
        staging: str = "auto",
        staging_bytes: int = 256 << 20,
        on_staged: Callable[[int], None] = lambda nbytes: None,
        verify: bool = True,
    ) -> None:
        self._moves = PageMoves(block_bytes, staging, staging_bytes, on_staged)
        self._route: Route | None = None
        self._client = ClusterClient(
            url,
            block_bytes=block_bytes,
            namespace=namespace,
            cluster=cluster,
            secret=secret,
            tenant=tenant,
            transports=transports,
            timeout=timeout,
            connections=connections,
            streams=streams,
            verify=verify,
        )
        if not self._client.members():
            _log.warning("kvbridge: cluster %r in %s has no members yet: misses", cluster, url)

    def members(self) -> list[str]:
        """The members the cluster places on now."""
        return self._client.members()

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        return self._client.match_prefix(keys)

    def pin(self, keys: Sequence[BlockKey], start: int = 0) -> Lease | None:
        try:
            return self._client.pin(keys, chain_start=start)
        except BlockNotFound:  # evicted since the lookup
            return None

    def unpin(self, hold: Lease) -> None:
        hold.release()

    def attach(self, memory: PageLayout, device: Device) -> None:
        self._moves.attach(memory, device)
        self._route = self._moves.route(cluster_mover(self._client))

    def load(self, keys: Sequence[BlockKey], offsets: np.ndarray, start: int = 0) -> None:
        self._moves.load(cluster_mover(self._client), self._routed(), keys, offsets, start)

    def save(
        self,
        keys: Sequence[BlockKey],
        offsets: np.ndarray,
        start: int = 0,
        lineage: Sequence[Lineage] = (),
    ) -> int:
        """A cluster's saves send no lineage yet (its members' streams carry keys only)."""
        return self._moves.save(cluster_mover(self._client), self._routed(), keys, offsets, start)

    def get(self, keys: Sequence[BlockKey], out: Sequence[Any], start: int = 0) -> None:
        self._client.get(keys, list(out), chain_start=start)

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Any], start: int = 0) -> int:
        return sum(self._client.put(keys, list(blocks), chain_start=start))

    def clear(self) -> int:
        return self._client.clear()

    def close(self) -> None:
        self._client.close()

    def _routed(self) -> Route:
        if self._route is None:
            raise LayoutError("no engine memory attached")
        return self._route
