"""StoreClient: a cache server with the surface of a local :class:`TieredStore`.

``put``/``get`` take the same buffers as the local store and move them without a copy:
the client registers the caller's buffer with its transfer engine for the duration of the
call, and the engine writes it straight into the server's staged slots (``put``) or reads
pinned slots straight into it (``get``). ``put_from``/``get_into`` do the same with a
region registered once (``client.register(buffer)``), for buffers that are reused.

Deduplication happens before any byte moves: the server stages slots only for the keys it
does not hold, and only those blocks are sent (``counters["bytes_saved"]`` adds up the rest).
Every blocking call has an awaitable twin (``aput``, ``aget``, ...) that runs it off the
event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn, cast

import msgpack
import numpy as np

from ..._closing import Closing
from ...transfer import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_PRINCIPAL,
    DEFAULT_STREAMS,
    MAX_CONTROL_BYTES,
    OP_DTYPE,
    AuthenticationError,
    Digests,
    PeerClosed,
    Region,
    RemoteProtocolError,
    TransferEngine,
    TransferError,
    TransferHandle,
    parse_address,
)
from .._checksums import NO_SUM, check_sums
from .._errors import BlockCorrupt, LeaseExpired, StoreClosed, StoreFull
from .._keys import BlockKey, check_keys, namespace_bytes
from .._lease import Lease
from .._lineage import (
    STAGE_LINEAGE_BYTES,
    TOKEN_BYTES,
    BadLineage,
    Lineage,
    check_block_tokens,
    lineage_bytes,
)
from .._sizes import positive_int
from .._stats import StoreStats, TierStats
from .._stream import KeySnapshot, Subscription
from .._wire import DEFAULT_PORT, ERRORS, MAX_KEYS_PER_REQUEST, error_for, field, raise_error
from ._registration import Locations as _Locations
from ._registration import Registration as _Registration
from ._registration import one_per_block, pages_of_blocks

SERVER_FAULTS = (TransferError, OSError, TimeoutError)
"""What a server's failure (killed, unreachable, too slow) looks like to its client: the
transfer layer's errors (``zmq`` errors never escape: they become ``PeerClosed``), the
operating system's, and a deadline passed. A refusal is a ``StoreError`` instead."""

_COURTESY_S = 0.1
"""Past a call's deadline, how long giving a lease back may wait (its TTL ends it anyway)."""


_TRUSTED_LEASE_FRACTION = 0.5
"""A read that finished within this part of the lease TTL (counted from before the pin
request left) ran under the pin for sure; later ones ask the server whether it held."""


class StoreClient(Closing):
    """A connection to ``kvbridge serve`` for one namespace and block size.

    ``address`` is ``host:port``. ``secret`` must match the server's: the shared secret,
    or with ``tenant`` that tenant's own (a server with ``--tenants``; see
    ``store/server/_tenants.py``). ``transports`` are the client engine's (the first one the
    server also offers is used). Pass ``engine`` to share a :class:`TransferEngine` the
    caller owns (it is not closed with the client; its principal is the tenant).

    Threads may share a client. Its requests to the server (stage, commit, pin, lookups)
    are answered one at a time, in the order they are sent: a lookup waits behind another
    thread's request, though not behind its bytes, since the bytes of several threads'
    puts and gets move at once over the client's streams. A :meth:`deadline` is its own
    thread's or task's. Where lookups must never queue behind other calls, give each caller
    a client of its own (:class:`~kvbridge.store.ClientPool` with ``per_server`` > 1).
    """

    def __init__(
        self,
        address: str = f"127.0.0.1:{DEFAULT_PORT}",
        *,
        block_bytes: int,
        namespace: bytes | str = b"",
        secret: bytes | str | None = None,
        tenant: str = DEFAULT_PRINCIPAL,
        transports: Sequence[str] | str = ("tcp",),
        timeout: float = 30.0,
        streams: int = DEFAULT_STREAMS,
        engine: TransferEngine | None = None,
        clock: Callable[[], float] = time.monotonic,
        block_tokens: int = 0,
        verify: bool = True,
    ) -> None:
        """``streams``: TCP data streams to the server (``TransferSettings.streams``; more
        where the machine has the cores to drive a fast link). ``clock`` times deadlines and
        how long a read ran under its pin (tests pass a fake one). ``block_tokens``: the
        token ids per block of the lineage this client's puts send (``put(lineage=...)``,
        ``docs/EVENTS.md``); 0 sends none. The namespace's creator chose how many it keeps:
        where that is another number, :attr:`block_tokens` is 0 after the open and puts
        send no lineage (logged once). ``verify``: check each block a get lands against the
        checksum its writer sent (``store/_checksums.py``; a put always sends them)."""
        positive_int("block_bytes", block_bytes)
        self.verify = verify
        self.block_bytes = block_bytes
        self._asked_tokens = check_block_tokens(block_tokens)
        self.block_tokens = 0
        """Token ids per block of the lineage puts send: as asked, where the namespace
        keeps that many; else 0 (none sent)."""
        self._said_refused = False
        self.namespace = namespace_bytes(namespace)
        self._own_engine = engine is None
        self.engine = engine or TransferEngine(
            f"kvbridge-client-{secrets.token_hex(4)}",
            transports=transports,
            secret=secret,
            principal=tenant,
            timeout=timeout,
            streams=streams,
            # A dead server must not cost more than one call's timeout to find out.
            connect_timeout=min(timeout, DEFAULT_CONNECT_TIMEOUT_S),
            serve=False,  # a client only dials: no listener, no control server
        )
        self.counters = {
            "bytes_pushed": 0,
            "bytes_saved": 0,
            "bytes_pulled": 0,
            "blocks_corrupt": 0,
        }
        self._timeout = timeout
        self._clock = clock
        self._closed = False
        self._reopen = False
        self._deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
            "kvbridge-store-client-deadline", default=None
        )
        """Per thread and asyncio task: a deadline is its caller's, never another's."""
        self._address = address
        try:
            self.peer = self.engine.dial(address)
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        request = {"op": "open", "namespace": self.namespace, "block_bytes": self.block_bytes}
        if self._asked_tokens:
            request["block_tokens"] = self._asked_tokens
        opened = self._call(request)
        kept = opened.get("block_tokens", 0)
        self.block_tokens = self._asked_tokens if kept == self._asked_tokens else 0
        if self._asked_tokens and not self.block_tokens and not self._said_refused:
            self._said_refused = True  # once, not again at each reopen
            _log.warning(
                "namespace %s keeps %s token ids a block, not %d: saves send no lineage "
                "(its events carry keys only)",
                self.namespace.decode(errors="replace"),
                kept,
                self._asked_tokens,
            )
        self.peer.refresh()  # the namespace's region may be newer than our handshake
        self._ns: int = opened["ns"]
        self._region: int = opened["region"]
        self.capacity_blocks: int = opened["capacity"]
        self.lease_ttl: float = opened["lease_ttl"]
        # A put or get stages or pins all of a request's blocks in host memory at once; the
        # server bounds a request (a share of the namespace, so others have room meanwhile).
        self._request_keys = max(1, min(MAX_KEYS_PER_REQUEST, int(opened["request_blocks"])))

    # -- the TieredStore surface -------------------------------------------------------

    def put(
        self, keys: Sequence[bytes], blocks: object, *, lineage: _Lineages = None
    ) -> list[bool]:
        """Store each block under its key; return, per key, whether this call sent it (a
        key the server already held is not sent). ``blocks``: one buffer of
        ``len(keys) * block_bytes`` bytes or a sequence of ``block_bytes`` buffers.

        As ``TieredStore.put``, raises :class:`StoreFull` before a byte moves when the new
        blocks do not fit in the namespace's unpinned room beside the put's stored ones,
        and no block of the put is evicted to make room for another of it. A put larger
        than one request (:attr:`request_keys`) moves a request at a time: a fault midway
        leaves the requests before it stored.

        ``lineage``: per key, what it was hashed from (:class:`Lineage`, ``None`` where not
        known), kept by the server beside the new blocks and reported in their events
        (a client opened with ``block_tokens``; :class:`BadLineage` before anything moves
        when an entry has other than ``block_tokens`` token ids)."""
        checked = check_keys(keys)
        if not checked:
            return []
        sent = self._lineage(lineage, len(checked))
        with _Registration(
            self.engine, self.block_bytes, blocks, len(checked), writable=False
        ) as where:
            return self._put(checked, where, sent)

    def put_from(
        self,
        keys: Sequence[bytes],
        region: Region,
        offsets: Sequence[int],
        *,
        lineage: _Lineages = None,
    ) -> list[bool]:
        """``put`` from a registered region: block ``i`` is at ``offsets[i]`` in it."""
        checked = check_keys(keys)
        where = one_per_block(region, offsets, len(checked), self.block_bytes)
        return self._put(checked, where, self._lineage(lineage, len(checked)))

    def get(self, keys: Sequence[bytes], out: object) -> None:
        """Fill ``out`` with the blocks of ``keys``; raises :class:`BlockNotFound` (``out``
        untouched) when any is absent."""
        checked = check_keys(keys)
        if not checked:
            return
        with _Registration(
            self.engine, self.block_bytes, out, len(checked), writable=True
        ) as where:
            self._get(checked, where)

    def get_into(self, keys: Sequence[bytes], region: Region, offsets: Sequence[int]) -> None:
        """``get`` into a registered region: block ``i`` lands at ``offsets[i]``."""
        checked = check_keys(keys)
        self._get(checked, one_per_block(region, offsets, len(checked), self.block_bytes))

    def put_pages(
        self,
        keys: Sequence[bytes],
        regions: Sequence[Region],
        offsets: np.ndarray,
        *,
        lineage: _Lineages = None,
    ) -> list[bool]:
        """``put`` of blocks made of pages spread over registered regions (a KV cache's
        layers): block ``i`` is ``len(regions)`` equal pages, page ``s`` at ``offsets[i, s]``
        in ``regions[s]``. The pages go straight to the server's slots, one op each."""
        checked = check_keys(keys)
        where = pages_of_blocks(regions, offsets, len(checked), self.block_bytes)
        return self._put(checked, where, self._lineage(lineage, len(checked)))

    def get_pages(
        self, keys: Sequence[bytes], regions: Sequence[Region], offsets: np.ndarray
    ) -> None:
        """``get`` into pages, laid out as for :meth:`put_pages`."""
        checked = check_keys(keys)
        self._get(checked, pages_of_blocks(regions, offsets, len(checked), self.block_bytes))

    def pin(self, keys: Sequence[bytes]) -> Lease:
        """Keep the blocks of ``keys`` from eviction for the server's lease TTL (a reader's
        guard between a lookup and its load), a request's worth of keys at a time; release
        the lease it returns (or leave its ``with`` block). All or nothing: raises
        :class:`BlockNotFound`, holding nothing, when a key is absent."""
        checked = check_keys(keys)
        deadline = self._clock() + self.lease_ttl
        taken: list[int] = []
        try:
            for first in range(0, len(checked), self._request_keys):
                chunk = list(checked[first : first + self._request_keys])
                lease = int(self._call({"op": "pin", "ns": self._ns, "keys": chunk})["lease"])
                taken.append(lease)
        except BaseException:
            self._release(taken)
            raise
        return Lease(lambda _: self._release(taken), self._clock, 0, tuple(checked), deadline)

    def _release(self, leases: list[int]) -> None:
        """End the server's read leases (an expired one is ignored: it is gone already)."""
        for lease in leases:
            if lease:
                self._quietly({"op": "release", "ns": self._ns, "lease": lease})

    @property
    def request_keys(self) -> int:
        """The most keys one request stages or pins (the server's bound; ``put`` and
        ``get`` split larger calls themselves)."""
        return self._request_keys

    def match_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys the server holds (the cache hit of a prefix, in blocks)."""
        checked = check_keys(keys)
        total = 0
        for start, chunk in _chunks(checked, MAX_KEYS_PER_REQUEST):
            count = int(self._call({"op": "match", "ns": self._ns, "keys": chunk})["count"])
            total = start + count
            if count < len(chunk):
                break
        return total

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        checked = check_keys(keys)
        present: list[bool] = []
        for _, chunk in _chunks(checked, MAX_KEYS_PER_REQUEST):
            present += self._call({"op": "contains", "ns": self._ns, "keys": chunk})["present"]
        return present

    def remove(self, keys: Sequence[bytes]) -> list[bool]:
        checked = check_keys(keys)
        removed: list[bool] = []
        for _, chunk in _chunks(checked, MAX_KEYS_PER_REQUEST):
            removed += self._call({"op": "remove", "ns": self._ns, "keys": chunk})["removed"]
        return removed

    def clear(self) -> int:
        """Remove every block of this namespace that no reader has pinned (every client of
        the namespace loses them); returns how many were removed."""
        return int(self._call({"op": "clear", "ns": self._ns})["removed"])

    def stats(self) -> StoreStats:
        """The namespace's store counters, as the server sees them."""
        known = {f.name for f in dataclasses.fields(StoreStats)} - {"tiers"}
        for entry in self.server_stats()["namespaces"]:
            if entry["handle"] == self._ns:  # its other figures (served, ...) are not these
                tiers = [TierStats(**t) for t in entry["tiers"]]
                return StoreStats(**{k: v for k, v in entry.items() if k in known}, tiers=tiers)
        raise LookupError("the server no longer lists this namespace")

    def server_stats(self) -> dict[str, Any]:
        return self._call({"op": "stats"})

    def subscription(self) -> Subscription:
        """A one-time ticket to this namespace's event stream (``docs/EVENTS.md``);
        :class:`BadRequest` when the server publishes none."""
        reply = self._call({"op": "events", "ns": self._ns})
        host, _ = parse_address(self._address)
        host = f"[{host}]" if ":" in host else host
        return Subscription(
            endpoint=f"tcp://{host}:{field(reply, 'port', int)}",
            topic=field(reply, "topic", bytes),
            ticket=field(reply, "ticket", bytes),
        )

    def snapshot(self, *, lineage: bool = False) -> KeySnapshot:
        """Every key of the namespace, and the event stream's sequence number they hold
        every change up to (read in pages of one snapshot); with ``lineage``, what each
        key was hashed from where the server keeps it."""
        request: dict[str, Any] = {"op": "keys", "ns": self._ns, "lineage": lineage}
        reply = self._call(request)
        sid, seq = field(reply, "snapshot", int), field(reply, "seq", int)
        keys: list[BlockKey] = []
        kept: list[Lineage | None] = []
        media: list[str | None] = []
        while True:
            page = check_keys(field(reply, "keys", list))
            keys += page
            if lineage:
                kept += _lineage_page(field(reply, "lineage", list), len(page))
                media += _media_page(field(reply, "media", list), len(page))
            if not field(reply, "more", bool):
                if not lineage:
                    return KeySnapshot(seq, keys)
                return KeySnapshot(seq, keys, kept, media)
            reply = self._call({**request, "snapshot": sid, "offset": len(keys)})

    @property
    def takes_device_memory(self) -> bool:
        """Whether GPU memory can be registered here (the transport in use is UCX's or
        NIXL's)."""
        return self.peer.transport in ("ucx", "nixl")

    def register(self, buffer: Any, *, access: str = "none") -> Region:
        """Register a buffer for ``put_from``/``get_into`` (keep it alive meanwhile). No
        peer may touch it (``access="none"``): only this client's own transfers move its
        bytes."""
        return self.engine.register(buffer, access=access)

    @contextlib.contextmanager
    def registered(self, buffer: Any) -> Iterator[Region]:
        """``buffer`` registered (as :meth:`register`) for the block only: a buffer that
        ``put_from``/``get_into`` move some blocks of once."""
        region = self.register(buffer)
        try:
            yield region
        finally:
            self.engine.unregister(region)

    @contextlib.contextmanager
    def deadline(self, seconds: float) -> Iterator[None]:
        """Bound the calls made inside the block to ``seconds`` in all: every wait for the
        server (each has ``timeout`` on its own) gets only what is left, and one that
        would start after the deadline raises ``TimeoutError``. A call of many blocks
        makes several requests; without this, each may take ``timeout``.

        The deadline belongs to the thread or asyncio task that entered the block (and to
        what it awaits, ``aget`` and friends included, and to tasks it creates inside the
        block, which copy its context as asyncio does): other threads, and tasks made
        outside it, never see it. Nested blocks keep the earlier of the two deadlines."""
        outer = self._deadline.get()
        until = self._clock() + seconds
        token = self._deadline.set(until if outer is None else min(outer, until))
        try:
            yield
        finally:
            self._deadline.reset(token)

    def close(self) -> None:
        self._closed = True
        peer = getattr(self, "peer", None)
        if peer is not None:
            peer.close()
        if self._own_engine:
            self.engine.close()

    # -- awaitable twins ---------------------------------------------------------------

    async def aput(self, keys: Sequence[bytes], blocks: object) -> list[bool]:
        return await asyncio.to_thread(self.put, keys, blocks)

    async def aget(self, keys: Sequence[bytes], out: object) -> None:
        await asyncio.to_thread(self.get, keys, out)

    async def aput_from(
        self, keys: Sequence[bytes], region: Region, offsets: Sequence[int]
    ) -> list[bool]:
        return await asyncio.to_thread(self.put_from, keys, region, offsets)

    async def aget_into(
        self, keys: Sequence[bytes], region: Region, offsets: Sequence[int]
    ) -> None:
        await asyncio.to_thread(self.get_into, keys, region, offsets)

    async def amatch_prefix(self, keys: Sequence[bytes]) -> int:
        return await asyncio.to_thread(self.match_prefix, keys)

    # -- internals ---------------------------------------------------------------------

    def _call(self, body: dict[str, Any]) -> dict[str, Any]:
        """One request; if the connection broke since the last one (the server restarted,
        a stream died, the session ended), connect and open the namespace again first. A
        namespace whose re-open failed (the server was full, or slow) is opened again
        before the next request."""
        if self._closed:
            raise StoreClosed("this client is closed")
        if body.get("op") != "open" and (self.peer.closed or self._reopen):
            self._reconnect(session=self.peer.closed)
            body = self._rebound(body)
        try:
            reply = self._answer(body)
        except AuthenticationError:
            if body.get("op") == "open":
                raise
            self._reconnect()  # the session is gone: leases it held are gone with it
            reply = self._answer(self._rebound(body))
        raise_error(reply)
        return reply

    def _answer(self, body: dict[str, Any]) -> dict[str, Any]:
        """The peer's answer within what is left; no answer before the caller's deadline
        is ``TimeoutError`` (the deadline ran out, not the server), as for a call that
        would start after it."""
        wait = self._left()
        try:
            return self.peer.call(body, timeout=wait)
        except PeerClosed:
            deadline = self._deadline.get()
            if wait < self._timeout and deadline is not None and self._clock() >= deadline:
                raise TimeoutError("the call ran past its deadline") from None
            raise

    def _left(self) -> float:
        """How long the next wait may take: the timeout, or less under a :meth:`deadline`
        (raises ``TimeoutError`` once it has passed)."""
        deadline = self._deadline.get()
        if deadline is None:
            return self._timeout
        left = deadline - self._clock()
        if left <= 0:
            raise TimeoutError("the call ran past its deadline")
        return min(self._timeout, left)

    def _reconnect(self, *, session: bool = True) -> None:
        self._reopen = True  # until the namespace is open again
        if session:
            self.peer.reconnect()
        self._open()
        self._reopen = False

    def _rebound(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with the namespace handle of the current session."""
        return {**body, "ns": self._ns} if "ns" in body else body

    def _lineage(self, lineage: _Lineages, count: int) -> list[list[bytes | None] | None] | None:
        """``put``'s ``lineage`` as it goes on the wire, every entry checked first; none
        where the namespace keeps none (:attr:`block_tokens` 0)."""
        if lineage is None or not self.block_tokens:
            return None
        if len(lineage) != count:
            raise BadLineage(f"{len(lineage)} lineage entries for {count} keys")
        want = self.block_tokens * TOKEN_BYTES
        if any(entry is not None and len(entry.tokens) != want for entry in lineage):
            raise BadLineage(f"this client sends {self.block_tokens} token ids a block")
        return [None if entry is None else entry.wire() for entry in lineage]

    def _put(
        self,
        keys: Sequence[BlockKey],
        where: _Locations,
        lineage: list[list[bytes | None] | None] | None = None,
    ) -> list[bool]:
        """Stage, write and commit ``keys`` a request at a time. A put of several requests
        is checked whole first, and the server keeps its blocks from being evicted by its
        own later requests (:meth:`_begin_put`) until it ends, well or not."""
        size = self._request_keys
        if lineage is not None:  # a request's lineage within the control plane's bound
            size = max(1, min(size, STAGE_LINEAGE_BYTES // lineage_bytes(self.block_tokens)))
        chunks = list(_chunks(keys, size))
        put = self._begin_put(keys) if len(chunks) > 1 else None
        sent: list[bool] = []
        try:
            for n, (start, chunk) in enumerate(chunks):
                request: dict[str, Any] = {"op": "stage", "ns": self._ns, "keys": chunk}
                if lineage is not None:
                    request["lineage"] = lineage[start : start + len(chunk)]
                if put is not None:
                    request.update(put=put, last=n == len(chunks) - 1)
                sent += self._put_request(request, start, where)
        except BaseException:
            if put is not None:  # its record would keep the blocks until the lease TTL
                self._end_put(put)
            raise
        return sent

    def _put_request(self, request: dict[str, Any], start: int, where: _Locations) -> list[bool]:
        """One staged request of a put: its keys' slots written and committed; per key,
        whether it was sent."""
        staged = self._call(request)
        self.counters["bytes_saved"] += int(staged["saved_bytes"])
        slots, lease = staged["slots"], int(staged["lease"])
        picked = [i for i, slot in enumerate(slots) if slot is not None]
        if lease:
            try:
                ops = self._ops(where, start, picked, [slots[i] for i in picked])
            except BaseException as exc:  # a bad reply: the slots go back before it raises
                self._abandon(lease, exc)
            self._write_and_commit(lease, ops, len(picked))
            self.counters["bytes_pushed"] += len(picked) * self.block_bytes
        return [slot is not None for slot in slots]

    def _write_and_commit(self, lease: int, ops: np.ndarray, blocks: int) -> None:
        """Write a staged put's bytes, each block hashed by the stream that sends it as it
        goes; the commit, with their checksums, rides the write's notification (made once
        every byte is in), or follows it as a call when it would not fit one (a request of
        more than about 7,000 blocks: up to 9 bytes a checksum)."""
        digests = self._digests(len(ops), blocks)

        def sums() -> list[int]:
            return [NO_SUM] * blocks if digests is None else _sums(digests)

        def commit() -> bytes:
            return cast(bytes, msgpack.packb(self._commit(lease, sums())))

        most = len(msgpack.packb(self._commit(lease, []))) + 4 + 9 * blocks  # array32, uint64s
        rides = most <= MAX_CONTROL_BYTES
        try:
            left = self._left()  # past the deadline: raises before a byte is read
            done = self.peer.write(ops, notify=commit if rides else None, digests=digests)
        except BaseException as exc:
            self._abandon(lease, exc)
        self._landed(lease, done, left)  # and committed, when the commit rode along
        if not rides:
            try:
                self._call(self._commit(lease, sums()))
            except BaseException as exc:
                self._abandon(lease, exc)

    def _commit(self, lease: int, sums: list[int]) -> dict[str, Any]:
        return {"op": "commit", "ns": self._ns, "lease": lease, "sums": sums}

    def _digests(self, ops: int, blocks: int) -> Digests | None:
        """What hashes each of ``blocks`` blocks of ``ops`` ops (its pages) as it moves."""
        return Digests(range(0, ops, ops // blocks)) if blocks else None

    def _landed(self, lease: int, done: TransferHandle, left: float) -> None:
        try:
            self.peer.wait(done, left)
        except TimeoutError:
            # The write may still be reading the caller's memory: close the streams
            # (joined) before raising, so that nothing reads it once put has returned;
            # the session ends, and the staging with it (nothing of it is committed).
            self.peer.close("a write did not finish in time")
            raise
        except BaseException as exc:
            self._abandon(lease, exc)

    def _abandon(self, lease: int, exc: BaseException) -> NoReturn:
        """A staged put that will not be committed: give its lease back, and raise the
        store's error for a refusal the server sent as a transfer error."""
        self._quietly({"op": "abort", "ns": self._ns, "lease": lease})
        if isinstance(exc, TransferError) and exc.code in ERRORS:
            raise error_for(exc.code, f"put not committed: {exc}") from exc
        raise exc

    def _end_put(self, put: int) -> None:
        """End the server's record of a put of several requests (its last staging does)."""
        self._quietly({"op": "stage", "ns": self._ns, "keys": [], "put": put, "last": True})

    def _begin_put(self, keys: Sequence[BlockKey]) -> int:
        """Start a put of several requests: the server records its keys, so that no request
        of it evicts a block another stored or found stored (each request makes room, and
        a chain with a hole never hits past it). :class:`StoreFull`, before a byte moves,
        when its new blocks do not fit beside its stored ones (as ``TieredStore.put``)."""
        put = secrets.randbits(63)
        new = room = 0
        for _, chunk in _chunks(list(dict.fromkeys(keys)), MAX_KEYS_PER_REQUEST):
            reply = self._call({"op": "room", "ns": self._ns, "keys": chunk, "put": put})
            new, room = new + int(reply["new"]), int(reply["room"])
        if new > room:
            self._end_put(put)
            raise StoreFull(
                f"{new} new block(s) but the namespace holds at most {max(room, 0)} more "
                "beside the put's stored ones (pinned and staged blocks stay): nothing was "
                "stored"
            )
        return put

    def _get(self, keys: Sequence[BlockKey], where: _Locations) -> None:
        for start, chunk in _chunks(keys, self._request_keys):
            pinned_at = self._clock()
            pinned = self._call({"op": "pin", "ns": self._ns, "keys": chunk})
            lease, slots = int(pinned["lease"]), pinned["slots"]
            expected = check_sums(pinned.get("sums"), len(chunk)) if self.verify else None
            try:
                ops = self._ops(where, start, list(range(len(chunk))), slots)
                bad = self._read(ops, expected)
            except TimeoutError:
                # The read may still be landing: close the streams (joined) so that no byte
                # arrives after the caller reused its buffer; the session and its pin end.
                self.peer.close("a read did not finish in time")
                raise
            except BaseException:
                self._quietly({"op": "release", "ns": self._ns, "lease": lease})
                raise
            release = {"op": "release", "ns": self._ns, "lease": lease}
            if self._clock() - pinned_at < self.lease_ttl * _TRUSTED_LEASE_FRACTION:
                self.peer.cast(release)  # the pin held while we read: no answer needed
            else:
                self._call(release)  # raises LeaseExpired if the bytes may have changed
            if bad is not None:
                self._corrupt(keys, start + bad)
            self.counters["bytes_pulled"] += len(chunk) * self.block_bytes

    def _read(self, ops: np.ndarray, expected: list[int] | None) -> int | None:
        """Read a pinned request's blocks, each hashed by the stream it lands on as soon as
        its last byte is in (while the later ones arrive); the index of the first that does
        not match its writer's checksum (``expected``; ``None``: nothing to check), or
        ``None``."""
        check = expected is not None and any(expected)
        digests = self._digests(len(ops), len(expected or ())) if check else None
        self.peer.wait(self.peer.read(ops, digests=digests), self._left())
        if expected is None or digests is None:
            return None
        return _first_bad(expected, _sums(digests))

    def _corrupt(self, keys: Sequence[BlockKey], bad: int) -> NoReturn:
        """Tell the server of a block that landed bad (it checks its own copy and drops it
        if that is bad too), and raise :class:`BlockCorrupt` from it on."""
        self.counters["blocks_corrupt"] += 1
        _log.warning(
            "block %s failed its checksum once landed: a miss from it on", keys[bad].hex()[:16]
        )
        self._quietly({"op": "verify", "ns": self._ns, "keys": [keys[bad]]})
        raise BlockCorrupt(keys[bad:], bad)

    def _ops(
        self, where: _Locations, start: int, picked: list[int], slots: list[int]
    ) -> np.ndarray:
        self._check_leased(slots)
        regions, offsets = where
        segments = regions.shape[1]
        part = self.block_bytes // segments
        index = np.asarray(picked, dtype=np.int64) + start
        ops = np.zeros((len(picked), segments), dtype=OP_DTYPE)
        ops["local_region"] = regions[index]
        ops["local_offset"] = offsets[index]
        ops["remote_region"] = self._region
        at = np.asarray(slots, dtype=np.uint64) * np.uint64(self.block_bytes)
        ops["remote_offset"] = at[:, None] + np.arange(segments, dtype=np.uint64) * np.uint64(part)
        ops["length"] = part
        return ops.reshape(-1)

    def _check_leased(self, slots: list[int]) -> None:
        """The slots a lease names, checked before an op is posted to them: whole slots of
        the namespace's region, each once. Over a one-sided transport (``nixl``) nothing on
        the server checks an op, so a bad reply must stop here: ``RemoteProtocolError``."""
        info = self.peer.regions.get(self._region)
        count = 0 if info is None else info.length // self.block_bytes
        if any(type(s) is not int or not 0 <= s < count for s in slots) or len(set(slots)) != len(
            slots
        ):
            raise RemoteProtocolError(
                f"the server's lease names slots outside its {count} or twice: {slots[:8]}"
            )

    def _quietly(self, body: dict[str, Any]) -> None:
        """Give a lease back after a failure; the lease (or the session) ending does the
        same if this fails."""
        wait = self._timeout
        deadline = self._deadline.get()
        if deadline is not None:  # past it, only a moment for the courtesy
            wait = min(wait, max(_COURTESY_S, deadline - self._clock()))
        with contextlib.suppress(TransferError, LeaseExpired, PeerClosed):
            self.peer.call(body, timeout=wait)


_log = logging.getLogger("kvbridge.client")

_Lineages = Sequence[Lineage | None] | None


def _lineage_page(entries: list[Any], count: int) -> list[Lineage | None]:
    """A snapshot page's lineage, one entry per key (``nil``: none kept)."""
    if len(entries) != count:
        raise BadLineage(f"a snapshot page of {count} keys with {len(entries)} lineage entries")
    return [None if entry is None else Lineage.of_wire(entry) for entry in entries]


def _media_page(media: list[Any], count: int) -> list[str | None]:
    if len(media) != count or any(m is not None and type(m) is not str for m in media):
        raise BadLineage(f"a snapshot page of {count} keys with {len(media)} media")
    return media


def _sums(digests: Digests) -> list[int]:
    """Per block, its checksum (``NO_SUM`` for a block in GPU memory)."""
    return [NO_SUM if value is None else value for value in digests.values()]


def _first_bad(expected: list[int], got: list[int]) -> int | None:
    """The index of the first landed block that does not match its writer's checksum
    (blocks without one, or in GPU memory, pass), or ``None``."""
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        if want != NO_SUM and have not in (want, NO_SUM):
            return i
    return None


def _chunks(keys: Sequence[BlockKey], size: int) -> Iterator[tuple[int, list[bytes]]]:
    for start in range(0, len(keys), size):
        yield start, list(keys[start : start + size])
