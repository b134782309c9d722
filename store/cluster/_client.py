"""ClusterClient: the ``StoreClient`` surface over a cluster of ``kvbridge serve`` processes
found in etcd.

Each block key lives on the member where rendezvous hashing weighs it most (``_rendezvous``);
the first ``replicated_blocks`` blocks of a chain (system prompts, shared documents: what
every request hits) also live on the next ``replicas - 1`` members. A call is split per
member and the parts run in parallel, one connection per member.

Faults are misses, never errors or hangs. A member that fails a call (killed, unreachable,
timed out) is left out of placement until etcd says it left and came back, or for
:data:`RETRY_DEAD_S`; its part of the call goes to the key's next member: a get reads the
replica (or finds nothing: a miss), a put stores there. A get also asks the next member
when the owner lacks a block, so the hit rate survives a member joining (the new owner is
empty, the previous one still has it). While etcd is away the client keeps the members it
last saw.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from ..._closing import Closing
from .._buffers import as_array
from .._errors import BlockNotFound, InvalidBlock, StoreClosed, StoreError
from .._keys import BlockKey, check_keys, namespace_bytes
from .._sizes import positive_int
from ..client import SERVER_FAULTS, ClientPool, StoreClient
from ._etcd import EtcdError, EtcdGateway, EtcdUnavailable
from ._join import DEFAULT_CLUSTER, members_prefix
from ._membership import Member, Membership
from ._rendezvous import Rendezvous

__all__ = ["ClusterClient"]

_log = logging.getLogger("kvbridge.cluster")
_T = TypeVar("_T")

REPLICATED_BLOCKS = 64
"""Leading blocks of a chain kept on ``replicas`` members: 1,024 tokens at 16 tokens a block.
Measured (``benches/replica_heads.py``) on the Kimi conversation trace (512-token blocks): a
prompt's first 1,024 tokens take 15.4% of all prefix hits with 3.9% of the distinct blocks (4x the
hits per byte), its first 2,048 tokens 22.4% with 10.5% (2.1x); in the synthetic trace hits
follow blocks (2.3-9% either way). So one more copy of the first 1,024 tokens costs about 4%
of memory and keeps about 15% of the hits through a node's loss."""

RETRY_DEAD_S = 10.0
"""A member that failed a call is tried again after this, if etcd still lists it."""


class ClusterClient(Closing):
    """``ClusterClient("etcd://HOST:PORT", block_bytes=..., namespace=...)``.

    ``cluster`` names the cluster (``kvbridge serve --cluster-name``). Keys at positions
    below ``replicated_blocks`` of their chain (``chain_start`` says where a call's first
    key sits, 0 by default) are stored on ``replicas`` members. ``secret``, ``tenant``,
    ``timeout`` and ``transports`` are every member connection's (a call to a dead member
    fails within ``timeout``).
    Raises ``ConnectionError`` when etcd cannot be reached at start.
    """

    def __init__(
        self,
        url: str,
        *,
        block_bytes: int,
        namespace: bytes | str = b"",
        cluster: str = DEFAULT_CLUSTER,
        secret: bytes | str | None = None,
        tenant: str = "",
        transports: Sequence[str] | str = ("tcp",),
        timeout: float = 10.0,
        replicas: int = 2,
        replicated_blocks: int = REPLICATED_BLOCKS,
    ) -> None:
        positive_int("block_bytes", block_bytes)
        namespace_bytes(namespace)
        if not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if replicas < 1 or replicated_blocks < 0:
            raise ValueError("replicas must be >= 1 and replicated_blocks >= 0")
        self.block_bytes = block_bytes
        self.replicas = replicas
        self.replicated_blocks = replicated_blocks
        self._clients = ClientPool(
            block_bytes=block_bytes,
            namespace=namespace,
            secret=secret,
            tenant=tenant,
            transports=transports,
            timeout=timeout,
        )
        self._lock = threading.Lock()
        self._dead: dict[str, float] = {}  # address -> when it failed
        self._ring = Rendezvous([])
        self._pool = concurrent.futures.ThreadPoolExecutor(8, "kvbridge-cluster")
        self._membership = Membership(
            EtcdGateway.from_url(url), members_prefix(cluster), on_change=self._on_members
        )
        try:
            self._membership.start()
        except (EtcdUnavailable, EtcdError) as exc:
            self._pool.shutdown()
            raise ConnectionError(f"cannot read the cluster from etcd: {exc}") from None

    # -- membership --------------------------------------------------------------------

    def members(self) -> list[str]:
        """The members placement uses now (live in etcd, not failed recently)."""
        return list(self._ring.members)

    @property
    def membership_stale(self) -> bool:
        """Whether etcd stopped answering: placement then uses the members it listed last."""
        return self._membership.stale

    def _on_members(self, members: dict[str, Member]) -> None:
        listed = {member.address for member in members.values()}  # where calls go
        with self._lock:
            for gone in set(self._dead) - listed:
                del self._dead[gone]  # it left: when it comes back, it is fresh
            self._rebuild(listed)
        self._clients.forget(listed)

    def _listed(self) -> set[str]:
        return {member.address for member in self._membership.members().values()}

    def _rebuild(self, listed: set[str]) -> None:
        now = time.monotonic()
        for address, since in list(self._dead.items()):
            if now - since >= RETRY_DEAD_S:
                del self._dead[address]
        live = sorted(listed - set(self._dead))
        if tuple(live) != self._ring.members:
            self._ring = Rendezvous(live)
            _log.info("placing over %d member(s): %s", len(live), ", ".join(live))

    def _failed(self, address: str, exc: BaseException) -> None:
        _log.warning("member %s failed (%s): its keys go to the next member", address, exc)
        with self._lock:
            self._dead[address] = time.monotonic()
            self._rebuild(self._listed())
        self._clients.drop(address)

    def _owners(self, keys: Sequence[BlockKey], chain_start: int) -> list[tuple[int, list[str]]]:
        """Per key, how many copies it has and its members, best first: the copies, then
        one more (where a block placed before a join or a failure may be found)."""
        if isinstance(chain_start, bool) or not isinstance(chain_start, int) or chain_start < 0:
            raise ValueError(f"chain_start must be a non-negative int, got {chain_start!r}")
        with self._lock:
            if self._dead:
                self._rebuild(self._listed())
            ring = self._ring
        order = ring.owners(keys, self.replicas + 1).tolist() if ring.members else []
        owners = []
        for i in range(len(keys)):
            row = [ring.members[j] for j in order[i]] if order else []
            copies = self.replicas if chain_start + i < self.replicated_blocks else 1
            copies = min(copies, len(row))
            owners.append((copies, row[: copies + 1]))
        return owners

    # -- the store surface -------------------------------------------------------------

    def put(self, keys: Sequence[bytes], blocks: object, *, chain_start: int = 0) -> list[bool]:
        """Store each block on its member(s); per key, whether a member newly stored it.
        Blocks for a member that fails go to the next member; a key no member took is
        ``False`` (a cache may drop a block; it never stores a wrong one)."""
        checked = check_keys(keys)
        rows = self._rows(blocks, len(checked), writable=False)
        owners = self._owners(checked, chain_start)
        stored = [False] * len(checked)
        failed = self._put_round(checked, rows, [o[:c] for c, o in owners], stored)
        if failed:  # once more, to the next member of each key whose member failed
            spare = [o[c:] if i in failed else [] for i, (c, o) in enumerate(owners)]
            self._put_round(checked, rows, spare, stored)
        return stored

    def _put_round(
        self,
        keys: Sequence[BlockKey],
        rows: np.ndarray,
        targets: list[list[str]],
        stored: list[bool],
    ) -> set[int]:
        """One parallel put per member; the key indices whose member failed."""
        groups = _group(targets)

        def put(address: str, index: list[int]) -> list[bool]:
            part = np.ascontiguousarray(rows[index])
            return self._call(address, lambda c: c.put([keys[i] for i in index], part))

        failed: set[int] = set()
        for _, index, result in self._fan_out(groups, put):
            if isinstance(result, BaseException):
                failed.update(index)
                continue
            for i, new in zip(index, result, strict=True):
                stored[i] = stored[i] or new
        return failed

    def get(self, keys: Sequence[bytes], out: object, *, chain_start: int = 0) -> None:
        """Fill ``out`` with the blocks of ``keys`` from whichever of their members has
        them; :class:`BlockNotFound` naming every key none has (``out`` untouched then)."""
        checked = check_keys(keys)
        target = self._rows(out, len(checked), writable=True)
        found = np.empty_like(target)
        ranks = _Ranks([o for _, o in self._owners(checked, chain_start)])
        left = set(range(len(checked)))
        while groups := ranks.next_round(left):
            missing, bad = self._get_round(checked, found, groups)
            ranks.avoid(bad)
            left = missing | (left - {i for index in groups.values() for i in index})
        if left:
            raise BlockNotFound([checked[i] for i in sorted(left)])
        target[...] = found

    def _get_round(
        self, keys: Sequence[BlockKey], found: np.ndarray, groups: dict[str, list[int]]
    ) -> tuple[set[int], set[str]]:
        """One parallel get per member into ``found``; the key indices still missing, and
        the members that failed or refused (not asked again in this call)."""

        def get(address: str, index: list[int]) -> set[int]:
            return self._call(address, lambda c: _get_what_is_there(c, keys, index, found))

        missing: set[int] = set()
        bad: set[str] = set()
        for address, index, result in self._fan_out(groups, get):
            if isinstance(result, BaseException):
                missing.update(index)
                bad.add(address)
            else:
                missing.update(result)
        return missing, bad

    def contains(self, keys: Sequence[bytes], *, chain_start: int = 0) -> list[bool]:
        """Per key, whether one of its members holds it (a parallel round per rank of
        member, for the keys not found yet)."""
        checked = check_keys(keys)
        candidates = [o for _, o in self._owners(checked, chain_start)]
        present = [False] * len(checked)

        def ask(address: str, index: list[int]) -> list[bool]:
            wanted = [checked[i] for i in index]
            return self._call(address, lambda c: c.contains(wanted))

        ranks = _Ranks(candidates)
        while groups := ranks.next_round({i for i, p in enumerate(present) if not p}):
            for address, index, result in self._fan_out(groups, ask):
                if isinstance(result, BaseException):
                    ranks.avoid({address})
                    continue
                for i, p in zip(index, result, strict=True):
                    present[i] = present[i] or p
        return present

    def match_prefix(self, keys: Sequence[bytes], *, chain_start: int = 0) -> int:
        """How many leading keys some member holds (one ``contains`` round per member)."""
        present = self.contains(keys, chain_start=chain_start)
        return next((i for i, p in enumerate(present) if not p), len(present))

    def remove(self, keys: Sequence[bytes], *, chain_start: int = 0) -> list[bool]:
        """Remove each key from every member that may hold it; per key, whether one did."""
        checked = check_keys(keys)
        groups = _group([o for _, o in self._owners(checked, chain_start)])
        removed = [False] * len(checked)

        def drop(address: str, index: list[int]) -> list[bool]:
            return self._call(address, lambda c: c.remove([checked[i] for i in index]))

        for _, index, result in self._fan_out(groups, drop):
            if not isinstance(result, BaseException):
                for i, r in zip(index, result, strict=True):
                    removed[i] = removed[i] or r
        return removed

    def close(self) -> None:
        self._membership.stop()
        self._pool.shutdown(wait=True)
        self._clients.close()

    # -- plumbing ----------------------------------------------------------------------

    def _rows(self, buffer: object, count: int, *, writable: bool) -> np.ndarray:
        flat = as_array(buffer, writable=writable)
        if not isinstance(flat, np.ndarray) or flat.size != count * self.block_bytes:
            raise InvalidBlock(
                f"need one host buffer of {count} x {self.block_bytes} bytes, got {flat.size}"
            )
        return flat.reshape(count, self.block_bytes)

    def _call(self, address: str, fn: Callable[[StoreClient], _T]) -> _T:
        """``fn`` on a client of ``address``, within one timeout in all."""
        with self._clients.lease(address) as (client, _):
            return fn(client)

    def _fan_out(
        self, groups: dict[str, list[int]], work: Callable[[str, list[int]], _T]
    ) -> list[tuple[str, list[int], _T | BaseException]]:
        """Run ``work(member, key indices)`` for every member at once; a member that fails
        is marked, and a member that refuses (StoreError) is not; either way that part's
        result is the exception, and the caller moves it to the next member."""
        try:
            futures = {a: self._pool.submit(work, a, index) for a, index in groups.items()}
        except RuntimeError:  # the pool was shut down: close() ran
            raise StoreClosed("the cluster client is closed") from None
        # Every part is waited for, whatever happens to the others: a part still running
        # could read the caller's buffer after this call returned.
        concurrent.futures.wait(futures.values())
        results: list[tuple[str, list[int], _T | BaseException]] = []
        for address, future in futures.items():
            try:
                results.append((address, groups[address], future.result()))
            except SERVER_FAULTS as exc:
                self._failed(address, exc)
                results.append((address, groups[address], exc))
            except StoreError as exc:  # refused (full, a lease ended): that part only
                _log.info("member %s refused a part: %s: %s", address, type(exc).__name__, exc)
                results.append((address, groups[address], exc))
        return results


def _group(
    targets: Sequence[Sequence[str]], index: Sequence[int] | None = None
) -> dict[str, list[int]]:
    """Key indices per member, from each key's list of members (``index[j]`` is the key
    index of ``targets[j]``; by default ``j`` itself)."""
    groups: dict[str, list[int]] = {}
    for j, members in enumerate(targets):
        for address in members:
            groups.setdefault(address, []).append(j if index is None else index[j])
    return groups


class _Ranks:
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


def _get_what_is_there(
    client: Any, keys: Sequence[BlockKey], index: list[int], found: np.ndarray
) -> set[int]:
    """Get ``keys[index]`` from one member into ``found``; the indices it lacks (one call
    when it has them all, two when some are missing)."""
    part = np.empty((len(index), found.shape[1]), np.uint8)
    try:
        client.get([keys[i] for i in index], part)
    except BlockNotFound as exc:
        missing = set(exc.keys)
        have = [i for i in index if keys[i] not in missing]
        if have:
            try:
                client.get([keys[i] for i in have], part[: len(have)])
            except BlockNotFound:
                return set(index)  # evicted meanwhile: ask the next member for all
            found[have] = part[: len(have)]
        return set(index) - set(have)
    found[index] = part
    return set()
