"""How a cluster call is split: the key indices each member gets (``Owners``), which member
to ask next for a key the last one lacked (``Ranks``), and the one-member parts of a read
or a pin that take what the member has and name what it lacks."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .._errors import BlockNotFound
from .._keys import BlockKey
from .._lease import Lease
from ..client import StoreClient

__all__ = [
    "ClusterRegion",
    "Owners",
    "Ranks",
    "get_what_is_there",
    "pin_what_is_there",
]


@dataclass(frozen=True)
class ClusterRegion:
    """A buffer registered with a cluster (``ClusterClient.register``): with each member's
    connection on its first use there. ``id`` is its place among the client's buffers;
    ``length`` its bytes; ``owner`` tells the client that registered it from another."""

    id: int
    length: int
    owner: int


class Owners:
    """Where a call's keys live: per key its members, best first (``order``, indices into
    ``members``), and how many copies it has (``copies``). A key's candidates are its
    copies and one more member (where a block placed before a join or a failure may be
    found). Every step is a numpy operation over all keys at once: a call of 1,000 keys
    costs no Python loop per key."""

    def __init__(self, members: tuple[str, ...], order: np.ndarray, copies: np.ndarray) -> None:
        self.members = members
        self.order = order
        """``(keys, width)`` member indices, best first."""
        self._copies = np.minimum(copies, order.shape[1])
        self.reach = np.minimum(self._copies + 1, order.shape[1])
        """Per key, how many of its members are candidates."""

    def __len__(self) -> int:
        return len(self._copies)

    def copies(self) -> dict[str, list[int]]:
        """Key indices per member, each key on each of its copies' members."""
        columns = np.arange(self.order.shape[1])[None, :]
        return self._groups(self.order, columns < self._copies[:, None])

    def spares(self, keys: set[int]) -> dict[str, list[int]]:
        """Key indices per member: each of ``keys`` on the member after its copies."""
        index = np.fromiter(sorted(keys), np.int64, len(keys))
        index = index[self._copies[index] < self.order.shape[1]]
        chosen = self.order[index, self._copies[index]]
        return self.grouped(chosen, index)

    def candidates(self) -> dict[str, list[int]]:
        """Key indices per member, each key on every one of its candidates."""
        columns = np.arange(self.order.shape[1])[None, :]
        return self._groups(self.order, columns < self.reach[:, None])

    def ranks(self) -> Ranks:
        return Ranks(self)

    def _groups(self, order: np.ndarray, take: np.ndarray) -> dict[str, list[int]]:
        rows, columns = np.nonzero(take)
        return self.grouped(order[rows, columns], rows)

    def grouped(self, chosen: np.ndarray, index: np.ndarray) -> dict[str, list[int]]:
        """``index[j]`` (ascending) goes to member ``chosen[j]``; per member, its indices
        in order."""
        groups: dict[str, list[int]] = {}
        for member in range(len(self.members)):
            mine = index[chosen == member]
            if len(mine):
                groups[self.members[member]] = mine.tolist()
        return groups


class Ranks:
    """Which member to ask next for each key: its candidates in rank order, skipping those
    that failed or refused earlier in the same call (each is asked at most once)."""

    def __init__(self, owners: Owners) -> None:
        self._owners = owners
        self._step = np.zeros(len(owners), np.int64)
        self._avoid = np.zeros(len(owners.members) + 1, bool)  # the last: "no member"

    def avoid(self, members: set[str]) -> None:
        for name in members:
            self._avoid[self._owners.members.index(name)] = True

    def next_round(self, wanted: np.ndarray) -> dict[str, list[int]]:
        """The next candidate of each wanted key (``wanted``: a mask over the keys), as key
        indices per member (empty: none left)."""
        owners = self._owners
        order, reach = owners.order, owners.reach
        if not order.shape[1]:
            return {}
        index = np.flatnonzero(wanted)
        for _ in range(order.shape[1]):  # skip avoided candidates (at most width of them)
            step = self._step[index]
            live = step < reach[index]
            current = np.where(live, order[index, np.minimum(step, order.shape[1] - 1)], -1)
            skip = live & self._avoid[current]
            if not skip.any():
                break
            self._step[index[skip]] += 1
        step = self._step[index]
        live = step < reach[index]
        index, step = index[live], step[live]
        self._step[index] += 1
        return owners.grouped(order[index, step], index)


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


def pin_what_is_there(
    client: StoreClient, keys: Sequence[BlockKey], index: list[int], leases: list[Lease]
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
