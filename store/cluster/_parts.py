"""How a cluster call is split: the key indices each member gets (``group``), which member
to ask next for a key the last one lacked (``Ranks``), and the one-member parts of a read
or a pin that take what the member has and name what it lacks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .._errors import BlockNotFound
from .._keys import BlockKey
from ..client import StoreClient

__all__ = [
    "ClusterRegion",
    "Ranks",
    "get_what_is_there",
    "group",
    "pin_what_is_there",
    "read_rows",
]


@dataclass(frozen=True)
class ClusterRegion:
    """A buffer registered with a cluster (``ClusterClient.register``): with each member's
    connection on its first use there. ``id`` is its place among the client's buffers;
    ``length`` its bytes; ``owner`` tells the client that registered it from another."""

    id: int
    length: int
    owner: int


def group(targets: Sequence[Sequence[str]]) -> dict[str, list[int]]:
    """Key indices per member, from each key's list of members."""
    groups: dict[str, list[int]] = {}
    for j, members in enumerate(targets):
        for address in members:
            groups.setdefault(address, []).append(j)
    return groups


class Ranks:
    """Which member to ask next for each key: its members in rank order, skipping those
    that failed or refused earlier in the same call (each is asked at most once)."""

    def __init__(self, candidates: list[list[str]]) -> None:
        self._candidates = candidates
        self._step = [0] * len(candidates)
        self._avoid: set[str] = set()

    def avoid(self, members: set[str]) -> None:
        self._avoid |= members

    def next_round(self, wanted: set[int]) -> dict[str, list[int]]:
        """The next member of each wanted key, as key indices per member (empty: none left)."""
        groups: dict[str, list[int]] = {}
        for i in sorted(wanted):
            row, step = self._candidates[i], self._step[i]
            while step < len(row) and row[step] in self._avoid:
                step += 1
            if step < len(row):
                groups.setdefault(row[step], []).append(i)
                step += 1
            self._step[i] = step
        return groups


def get_what_is_there(
    keys: Sequence[BlockKey], index: list[int], read: Callable[[list[int]], None]
) -> set[int]:
    """``read(index)`` from one member; when it lacks some keys (``BlockNotFound``), read
    the ones it has instead. The indices it lacks (one call when it has them all, two when
    some are missing; all of them when blocks went meanwhile)."""
    try:
        read(index)
    except BlockNotFound as exc:
        missing = set(exc.keys)
        have = [i for i in index if keys[i] not in missing]
        if have:
            try:
                read(have)
            except BlockNotFound:
                return set(index)  # evicted meanwhile: ask the next member for all
        return set(index) - set(have)
    return set()


def read_rows(
    client: StoreClient, keys: Sequence[BlockKey], found: np.ndarray
) -> Callable[[list[int]], None]:
    """A ``read`` for :func:`get_what_is_there` through a buffer of its own, copied into
    the rows of ``found`` only once whole (a failed read leaves them as they were)."""

    def read(index: list[int]) -> None:
        part = np.empty((len(index), found.shape[1]), np.uint8)
        client.get([keys[i] for i in index], part)
        found[index] = part

    return read


def pin_what_is_there(
    client: StoreClient, keys: Sequence[BlockKey], index: list[int], leases: list[int]
) -> set[int]:
    """Pin ``keys[index]`` on one member, a request's worth at a time, appending each lease
    to ``leases``; the indices it lacks."""
    missing: set[int] = set()
    step = client.request_keys
    for start in range(0, len(index), step):
        chunk = index[start : start + step]

        def pin(part: list[int]) -> None:
            leases.append(client.pin([keys[i] for i in part]))

        missing |= get_what_is_there(keys, chunk, pin)
    return missing
