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
last saw. A member killed under a call is noticed by that call within milliseconds (its
connection drops: see ``transfer/_control_client.py``), not after the timeout.

Zero-copy: a buffer registered once (:meth:`ClusterClient.register`) is registered with
each member's connection on its first use there; ``put_from``/``get_into``/``put_pages``/
``get_pages`` then move blocks straight between it and each member's slots, every member's
part at once. :meth:`ClusterClient.pin` is a cluster lease: one lease on each member that
holds some of the keys, all released together.
"""

from __future__ import annotations

import concurrent.futures
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

import numpy as np

from ..._closing import Closing
from ...transfer import DEFAULT_STREAMS, LocalProtocolError, Region, is_device
from .._buffers import as_array, copy_into, split_blocks, to_host
from .._errors import BlockNotFound, BlockPinned, InvalidBlock, StoreClosed, StoreError
from .._keys import BlockKey, check_keys, namespace_bytes
from .._lease import Lease
from .._sizes import positive_int
from ..client import SERVER_FAULTS, ClientPool, Lent, pages_of_blocks
from ._etcd import EtcdError, EtcdGateway, EtcdUnavailable
from ._join import DEFAULT_CLUSTER, members_prefix
from ._membership import Member, Membership
from ._parts import (
    ClusterRegion,
    Owners,
    get_what_is_there,
    pin_what_is_there,
)
from ._rendezvous import Rendezvous

__all__ = ["ClusterClient", "ClusterRegion"]

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

_Store = Callable[[str, Lent, list[int]], list[bool]]
"""One member's part of a put: its key indices stored through a lent client."""
_Fetch = Callable[[str, Lent, list[int]], set[int]]
"""One member's part of a read: the key indices it lacked."""


class ClusterClient(Closing):
    """``ClusterClient("etcd://HOST:PORT", block_bytes=..., namespace=...)``.

    ``cluster`` names the cluster (``kvbridge serve --cluster-name``). Keys at positions
    below ``replicated_blocks`` of their chain (``chain_start`` says where a call's first
    key sits, 0 by default) are stored on ``replicas`` members. ``secret``, ``tenant``,
    ``timeout``, ``transports``, ``streams`` and ``verify`` (``StoreClient``'s: check what a
    get lands against its writer's checksums) are every member connection's (a call to a
    member that does not answer fails within ``timeout``); ``connections`` clients per
    member let that many threads call one member at once.
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
        connections: int = 1,
        streams: int = DEFAULT_STREAMS,
        verify: bool = True,
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
        self._transports = (transports,) if isinstance(transports, str) else tuple(transports)
        self._clients = ClientPool(
            per_server=connections,
            block_bytes=block_bytes,
            namespace=namespace,
            secret=secret,
            tenant=tenant,
            transports=transports,
            timeout=timeout,
            streams=streams,
            verify=verify,
        )
        self._buffers: list[object | None] = []  # in ClusterRegion.id order; None: failed
        self._owner = secrets.randbits(63)  # on this client's ClusterRegions
        self._clients.prepare(lambda client: [])  # per client: its Regions of _buffers
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

    def _owners(self, keys: Sequence[BlockKey], chain_start: int) -> Owners:
        """Where ``keys`` live: their members best first, and how many copies each has."""
        if isinstance(chain_start, bool) or not isinstance(chain_start, int) or chain_start < 0:
            raise ValueError(f"chain_start must be a non-negative int, got {chain_start!r}")
        with self._lock:
            if self._dead:
                self._rebuild(self._listed())
            ring = self._ring
        order = ring.owners(keys, self.replicas + 1)
        heads = np.arange(chain_start, chain_start + len(keys)) < self.replicated_blocks
        return Owners(ring.members, order, np.where(heads, self.replicas, 1))

    # -- the store surface -------------------------------------------------------------

    def put(self, keys: Sequence[bytes], blocks: object, *, chain_start: int = 0) -> list[bool]:
        """Store each block on its member(s); per key, whether a member newly stored it.
        ``blocks`` is one host buffer of the blocks in order (each member's part moves
        straight from it), or a buffer per block (copied once into one). Blocks for a
        member that fails go to the next member; a key no member took is ``False`` (a cache
        may drop a block; it never stores a wrong one)."""
        checked = check_keys(keys)
        flat = self._flat(blocks, len(checked), writable=False)

        def store(address: str, lent: Lent, index: list[int]) -> list[bool]:
            with lent.client.registered(flat) as region:
                at = (np.asarray(index, np.int64) * self.block_bytes).tolist()
                return lent.client.put_from([checked[i] for i in index], region, at)

        return self._put(checked, chain_start, store)

    def put_pages(
        self,
        keys: Sequence[bytes],
        regions: Sequence[ClusterRegion],
        offsets: object,
        *,
        chain_start: int = 0,
    ) -> list[bool]:
        """``put`` of blocks made of pages in registered buffers (``StoreClient.put_pages``:
        block ``i``'s page ``s`` at ``offsets[i, s]`` in ``regions[s]``), each member's
        part straight from them."""
        checked = check_keys(keys)
        at = self._page_offsets(regions, offsets, len(checked))

        def store(address: str, lent: Lent, index: list[int]) -> list[bool]:
            on = self._registered(lent, regions)
            return lent.client.put_pages([checked[i] for i in index], on, at[index])

        return self._put(checked, chain_start, store)

    def put_from(
        self,
        keys: Sequence[bytes],
        region: ClusterRegion,
        offsets: Sequence[int],
        *,
        chain_start: int = 0,
    ) -> list[bool]:
        """``put`` from a registered buffer: block ``i`` is at ``offsets[i]`` in it."""
        return self.put_pages(keys, [region], _column(offsets), chain_start=chain_start)

    def _put(self, keys: Sequence[BlockKey], chain_start: int, store: _Store) -> list[bool]:
        owners = self._owners(keys, chain_start)
        stored = [False] * len(keys)
        failed = self._put_round(store, owners.copies(), stored)
        if failed:  # once more, to the next member of each key whose member failed
            self._put_round(store, owners.spares(failed), stored)
        return stored

    def _put_round(
        self, store: _Store, groups: dict[str, list[int]], stored: list[bool]
    ) -> set[int]:
        """One parallel put per member; the key indices whose member failed."""
        failed: set[int] = set()
        for _, index, result in self._fan_out(groups, store):
            if isinstance(result, BaseException):
                failed.update(index)
                continue
            for i, new in zip(index, result, strict=True):
                stored[i] = stored[i] or new
        return failed

    def get(self, keys: Sequence[bytes], out: object, *, chain_start: int = 0) -> None:
        """Fill ``out`` (one host buffer, or a buffer per block) with the blocks of
        ``keys`` from whichever of their members has them, each member's part straight
        into a single buffer; :class:`BlockNotFound` naming every key none has (the blocks
        that were found may have landed then, as a failed load's do)."""
        checked = check_keys(keys)
        arrays, at = split_blocks(out, len(checked), self.block_bytes, writable=True)
        if not checked:
            return
        single = at is not None and isinstance(arrays[0], np.ndarray)
        flat = as_array(out, writable=True) if single else self._flat(out, len(checked), True)

        def fetch(address: str, lent: Lent, index: list[int]) -> set[int]:
            with lent.client.registered(flat) as region:

                def read(part: list[int]) -> None:
                    offsets = (np.asarray(part, np.int64) * self.block_bytes).tolist()
                    lent.client.get_into([checked[i] for i in part], region, offsets)

                return get_what_is_there(checked, index, read)

        _all_found(checked, self._rounds(checked, chain_start, fetch))
        if not single:  # read into a buffer of our own: now into the caller's
            rows = flat.reshape(len(checked), self.block_bytes)
            for array, row in zip(arrays, rows, strict=True):
                copy_into(array, row)

    def get_pages(
        self,
        keys: Sequence[bytes],
        regions: Sequence[ClusterRegion],
        offsets: object,
        *,
        chain_start: int = 0,
    ) -> None:
        """``get`` into pages of registered buffers, laid out as for :meth:`put_pages`,
        each member's part straight into them. On :class:`BlockNotFound` the blocks that
        were found may have landed (as a failed load's do: the engine computes them)."""
        checked = check_keys(keys)
        at = self._page_offsets(regions, offsets, len(checked))

        def fetch(address: str, lent: Lent, index: list[int]) -> set[int]:
            on = self._registered(lent, regions)

            def read(part: list[int]) -> None:
                lent.client.get_pages([checked[i] for i in part], on, at[part])

            return get_what_is_there(checked, index, read)

        _all_found(checked, self._rounds(checked, chain_start, fetch))

    def get_into(
        self,
        keys: Sequence[bytes],
        region: ClusterRegion,
        offsets: Sequence[int],
        *,
        chain_start: int = 0,
    ) -> None:
        """``get`` into a registered buffer: block ``i`` lands at ``offsets[i]``."""
        self.get_pages(keys, [region], _column(offsets), chain_start=chain_start)

    # -- pins --------------------------------------------------------------------------

    def pin(self, keys: Sequence[bytes], *, chain_start: int = 0) -> Lease:
        """Keep the blocks of ``keys`` from eviction on the members that hold them (each
        key on the first of its members that has it, the member a read asks first) for
        their lease TTL; release the lease it returns (or leave its ``with`` block).
        :class:`BlockNotFound` (nothing pinned) when no member holds a key."""
        checked = check_keys(keys)
        taken: dict[str, list[Lease]] = {}

        def fetch(address: str, lent: Lent, index: list[int]) -> set[int]:
            leases = taken.setdefault(address, [])
            return pin_what_is_there(lent.client, checked, index, leases)

        try:
            _all_found(checked, self._rounds(checked, chain_start, fetch, first=True))
        except BaseException:  # all or nothing
            self._release(taken)
            raise
        deadline = min((lease.deadline for held in taken.values() for lease in held), default=0.0)
        return Lease(lambda _: self._release(taken), time.monotonic, 0, tuple(checked), deadline)

    def _release(self, taken: dict[str, list[Lease]]) -> None:
        """End a pin's leases on every member (a member that is gone took its leases along)."""
        groups = {address: list(range(len(held))) for address, held in taken.items()}

        def give_back(address: str, lent: Lent, index: list[int]) -> list[bool]:
            for i in index:
                taken[address][i].release()
            return []

        self._fan_out({a: i for a, i in groups.items() if i}, give_back, first=True)

    def contains(self, keys: Sequence[bytes], *, chain_start: int = 0) -> list[bool]:
        """Per key, whether one of its members holds it (a parallel round per rank of
        member, for the keys not found yet)."""
        checked = check_keys(keys)

        def ask(address: str, lent: Lent, index: list[int]) -> set[int]:
            present = lent.client.contains([checked[i] for i in index])
            return {i for i, p in zip(index, present, strict=True) if not p}

        absent = self._rounds(checked, chain_start, ask)
        return [i not in absent for i in range(len(checked))]

    def match_prefix(self, keys: Sequence[bytes], *, chain_start: int = 0) -> int:
        """How many leading keys some member holds (one ``contains`` round per member)."""
        present = self.contains(keys, chain_start=chain_start)
        return next((i for i, p in enumerate(present) if not p), len(present))

    def remove(self, keys: Sequence[bytes], *, chain_start: int = 0) -> list[bool]:
        """Remove each key from every member that may hold it; per key, whether one did.
        :class:`BlockPinned` when a member refused because a lease pins a block there (that
        member removed nothing; other members may have dropped their copies). A member that
        fails otherwise is passed over: what it holds is not served while it is down."""
        checked = check_keys(keys)
        removed = [False] * len(checked)

        def drop(address: str, lent: Lent, index: list[int]) -> list[bool]:
            return lent.client.remove([checked[i] for i in index])

        groups = self._owners(checked, chain_start).candidates()
        for _, index, result in self._fan_out(groups, drop):
            if isinstance(result, BlockPinned):
                raise result
            if not isinstance(result, BaseException):
                for i, r in zip(index, result, strict=True):
                    removed[i] = removed[i] or r
        return removed

    def clear(self) -> int:
        """Remove every block of the namespace that no reader holds from every member etcd
        lists (one that failed a call lately too: it would serve its blocks again); how
        many were removed. ``ConnectionError`` naming the members that could not clear
        (the others did)."""
        groups: dict[str, list[int]] = {address: [] for address in sorted(self._listed())}

        def drop(address: str, lent: Lent, index: list[int]) -> int:
            return lent.client.clear()

        results = self._fan_out(groups, drop)
        failed = [address for address, _, r in results if isinstance(r, BaseException)]
        if failed:
            raise ConnectionError(f"members {', '.join(failed)} did not clear the namespace")
        return sum(r for _, _, r in results if isinstance(r, int))

    @property
    def takes_device_memory(self) -> bool:
        """Whether GPU memory can be registered (every member connection is UCX's, or
        every one NIXL's)."""
        return self._transports in (("ucx",), ("nixl",))

    def register(self, buffer: object) -> ClusterRegion:
        """Register a buffer for ``put_from``/``get_into``/``put_pages``/``get_pages``
        (keep it alive while the client is): with each member's connection on its first
        use there, once. Memory on a GPU needs UCX among the ``transports``
        (``LocalProtocolError`` otherwise: stage it through host memory)."""
        if is_device(buffer) and not self.takes_device_memory:
            raise LocalProtocolError(
                "GPU memory moves over UCX only: a cluster client needs transports=('ucx',)"
            )
        device = is_device(buffer)
        nbytes = _device_bytes(buffer) if device else as_array(buffer, writable=True).nbytes
        with self._lock:
            self._buffers.append(buffer)
            region = ClusterRegion(len(self._buffers) - 1, nbytes, self._owner)
        if device:
            self._check_registers(region)
        return region

    def _check_registers(self, region: ClusterRegion) -> None:
        """Register GPU memory with one member's connection now: what this process cannot
        register (no cupy, not contiguous) is ``LocalProtocolError`` here, where a caller
        can stage instead, not a failure of every member at the first load. (No member
        yet: checked on first use, where it is :class:`InvalidBlock`.)"""
        for address in self.members()[:1]:
            try:
                with self._clients.lease(address) as lent:
                    self._registered(lent, [region])
            except InvalidBlock as exc:
                with self._lock:
                    self._buffers[region.id] = None  # no later call registers it
                raise LocalProtocolError(str(exc)) from None
            except SERVER_FAULTS as exc:
                _log.debug("registration not checked on %s: %s", address, exc)

    def close(self) -> None:
        self._membership.stop()
        self._pool.shutdown(wait=True)
        self._clients.close()

    # -- plumbing ----------------------------------------------------------------------

    def _flat(self, buffer: object, count: int, writable: bool) -> np.ndarray:
        """The blocks as one host buffer: ``buffer`` itself where it is one, else a copy of
        them (a buffer per block, or memory on a GPU)."""
        if not isinstance(buffer, (list, tuple)):
            flat = as_array(buffer, writable=writable)
            if isinstance(flat, np.ndarray) and flat.size == count * self.block_bytes:
                return flat.reshape(-1)
        arrays, _ = split_blocks(buffer, count, self.block_bytes, writable=writable)
        rows = np.empty((count, self.block_bytes), np.uint8)
        if not writable:
            for row, array in zip(rows, arrays, strict=True):
                row[...] = to_host(array)
        return rows.reshape(-1)

    def _page_offsets(
        self, regions: Sequence[ClusterRegion], offsets: object, count: int
    ) -> np.ndarray:
        """``offsets`` checked against the regions (:class:`InvalidBlock` before any member
        is asked), as int64 rows of one offset per page."""
        with self._lock:
            known = len(self._buffers)
        if not all(
            isinstance(r, ClusterRegion) and r.owner == self._owner and 0 <= r.id < known
            for r in regions
        ):
            raise InvalidBlock("regions must be this cluster client's (ClusterClient.register)")
        _, at = pages_of_blocks(regions, np.asarray(offsets), count, self.block_bytes)
        return at.astype(np.int64)

    def _registered(self, lent: Lent, regions: Sequence[ClusterRegion]) -> list[Region]:
        """The member client's own regions for ``regions``, registering the buffers it has
        not registered yet (the caller holds the client)."""
        made: list[Region | None] = lent.prepared
        last = max(r.id for r in regions)
        while len(made) <= last:
            buffer = self._buffers[len(made)]
            try:
                made.append(None if buffer is None else lent.client.register(buffer))
            except LocalProtocolError as exc:  # this process's memory, not the member
                raise InvalidBlock(f"cannot register buffer {len(made)}: {exc}") from None
        found = [made[r.id] for r in regions]
        if any(region is None for region in found):
            raise InvalidBlock("a buffer whose registration failed")
        return [region for region in found if region is not None]

    def _rounds(
        self, keys: Sequence[BlockKey], chain_start: int, fetch: _Fetch, *, first: bool = False
    ) -> set[int]:
        """Rounds of parallel reads, each key from its next member, until every key was
        read or no member is left to ask; the indices of the keys no member had."""
        ranks = self._owners(keys, chain_start).ranks()
        left = np.ones(len(keys), bool)
        while groups := ranks.next_round(left):
            for address, index, result in self._fan_out(groups, fetch, first=first):
                left[index] = False
                if isinstance(result, BaseException):
                    left[index] = True
                    ranks.avoid({address})  # failed or refused: not asked again
                elif result:
                    left[list(result)] = True
        return set(np.flatnonzero(left).tolist())

    def _fan_out(
        self,
        groups: dict[str, list[int]],
        work: Callable[[str, Lent, list[int]], _T],
        *,
        first: bool = False,
    ) -> list[tuple[str, list[int], _T | BaseException]]:
        """Run ``work(member, lent client, key indices)`` for every member at once, each
        within one timeout (``first``: on the member's first client, whose session holds
        the pins); a member that fails is marked, and a member that refuses (StoreError)
        is not; either way that part's result is the exception, and the caller moves it to
        the next member. One member's part runs on the calling thread."""

        def part(address: str, index: list[int]) -> _T:
            with self._clients.lease(address, first=first) as lent:
                return work(address, lent, index)

        if not groups:
            return []
        (here, mine), *others = groups.items()
        try:
            futures = {a: self._pool.submit(part, a, index) for a, index in others}
        except RuntimeError:  # the pool was shut down: close() ran
            raise StoreClosed("the cluster client is closed") from None
        futures[here] = _run(part, here, mine)
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


def _run(part: Callable[[str, list[int]], _T], address: str, index: list[int]) -> Future[_T]:
    """``part`` run here, its outcome as a finished future."""
    done: Future[_T] = Future()
    try:
        done.set_result(part(address, index))
    except BaseException as exc:  # handed over whole, as the pool's futures do
        done.set_exception(exc)
    return done


def _all_found(keys: Sequence[BlockKey], absent: set[int]) -> None:
    """:class:`BlockNotFound` naming the keys no member had, if any."""
    if absent:
        raise BlockNotFound([keys[i] for i in sorted(absent)])


def _column(offsets: Sequence[int]) -> np.ndarray:
    """One offset per block as the one-page rows ``put_pages`` takes."""
    return np.asarray(offsets).reshape(-1, 1)


def _device_bytes(buffer: object) -> int:
    """The bytes of a GPU buffer (a torch tensor or a cupy array)."""
    nbytes = getattr(buffer, "nbytes", None)
    if not isinstance(nbytes, int):
        raise InvalidBlock(f"cannot tell the size of {type(buffer).__name__}")
    return nbytes
