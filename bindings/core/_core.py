"""The engine-agnostic half of a KV connector: block keys from token ids, lookups that
remember failures, pins between a lookup and its load, loads, saves off the step, and
the counters. An engine adapter (``bindings/vllm/_connector.py``) maps its engine's calls onto this.

Faults stay local: a store that is unreachable, slow or refuses a call makes the
connector answer "nothing cached" (the engine computes the tokens) and log a warning; it
is asked again after ``_RETRY_AFTER_S``. A key whose load failed is not advertised again
for ``failed_key_ttl`` seconds, so an engine that re-asks after a failure cannot loop.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..._closing import Closing
from ...store import (
    BlockCorrupt,
    BlockKey,
    CacheServer,
    ConfigError,
    KeyMirror,
    Lease,
    LeaseExpired,
    Lineage,
    StoreClient,
    StoreClosed,
    StoreError,
    prefix_hashes,
)
from ...store.client import SERVER_FAULTS
from ...store.cluster import ClusterMirror
from ...transfer import is_device
from ._backend import Backend, ServerBackend
from ._cluster_backend import ClusterBackend
from ._config import ETCD_SCHEME, ConnectorConfig
from ._device import Device, HostDevice, current_cuda, device_for, select_cuda
from ._embedded import embedded_server
from ._identity import Identity
from ._jobs import SaveJob, Saver
from ._pages import LayoutError, PageLayout, check_memory
from ._staging import StagingFailed, pinned_bytes
from ._stats import ConnectorStats

_log = logging.getLogger("kvbridge.bindings")

_RETRY_AFTER_S = 5.0
"""After a store fault, calls are skipped (a miss, nothing saved) for this long."""

_MIRROR_TIMEOUT_S = 10.0
"""The mirror's calls (a ticket, a snapshot's pages) give up sooner than a load."""

_PROBE = BlockKey(bytes(32))
"""A key no block has: asked once a connection is made, so that the first lookup an
engine waits for does not pay the path's one-time costs (about 15 ms measured)."""

FAULTS = (StoreError, *SERVER_FAULTS)
"""What a store call may raise that is the store's fault, not the engine's: a server's
failure (``SERVER_FAULTS``: a control socket torn down under a call in flight included) or
a refusal (``StoreError``)."""


class ConnectorCore(Closing):
    """One side (lookups, or loads and saves) of a connector over one store."""

    def __init__(
        self,
        config: ConnectorConfig,
        identity: Identity,
        *,
        saves: bool = False,
        mirror: bool = False,
        connections: int = 1,
        clock: Callable[[], float] = time.monotonic,
        device: Device | None = None,
        token_ids: bool = False,
    ) -> None:
        """``saves``: run :meth:`save_later` jobs on a thread of its own; ``token_ids``: the
        engine's saves send their blocks' token ids (:meth:`lineage`), so the namespace is
        opened to keep them (vLLM's; SGLang hands over page hashes only); ``mirror``: keep
        the namespace's keys from the server's event stream (:meth:`mirrored`; where
        ``config.mirror`` allows it); ``connections``: how many threads may call the store
        at once (see :class:`ServerBackend`); ``device``: how moves are ordered against the
        engine's device work (``_device``; by default that of the memory attached)."""
        self.config = config
        self._connections = connections
        self.identity = identity
        tenant = f"{config.tenant}/".encode() if config.tenant else b""
        self.namespace = tenant + identity.namespace()  # inside the tenant's default prefix
        self._name_key = hashlib.blake2b(self.namespace, digest_size=32).digest()
        self.block_tokens = identity.block_tokens
        self._lineage_tokens = identity.block_tokens if token_ids else 0
        self.stats = ConnectorStats()
        self._clock = clock
        self._failed: dict[BlockKey, float] = {}
        self._down_until = 0.0
        self._quiet_until = 0.0
        """Until then, faults are counted but not logged again."""
        self._lock = threading.Lock()
        self._memory: PageLayout | None = None
        self._given_device = device
        self._device: Device = device or HostDevice()
        self._device_lost = False
        self._cuda = current_cuda()
        """The engine's CUDA device (its worker's), selected on the connection threads."""
        self._target: tuple[str, bytes | None] | None = None
        self._backend: Backend | None = None
        self._connecting = threading.Lock()
        """Guards the backend, the target and the engine's memory (never held long)."""
        self._dialling = threading.Lock()
        """One connection attempt at a time."""
        self._reaching: list[threading.Thread] = []
        """Connections made in the background (joined by :meth:`close`)."""
        self._closed = False
        self._wants_mirror = mirror and config.mirror
        self._mirror: KeyMirror | ClusterMirror | None = None
        self._embedded: CacheServer | None = None
        if config.server is not None:
            self.connect(config.server, config.secret)
        self._saver = Saver(self.run_save) if saves else None
        _log.info(
            "kvbridge connector: namespace %s, %d-byte blocks of %d tokens",
            self.namespace.decode(errors="replace"),
            identity.block_bytes,
            identity.block_tokens,
        )

    # -- where the blocks are -------------------------------------------------------------

    def connect(self, address: str, secret: bytes | None) -> None:
        """Use the cache server at ``address`` (the configured one, or the one the engine's
        worker runs: see :meth:`host`). It is reached on a thread of its own, never here:
        an engine starts as fast without its cache server as with it. A server that does
        not answer is a warning, and asked again after the pause by the next call."""
        with self._connecting:
            old, self._backend = self._backend, None
            old_mirror, self._mirror = self._mirror, None
            self._target = (address, secret)
            self._down_until = 0.0
            if self._closed:
                return
            reach = threading.Thread(target=self._up, name="kvbridge-connect", daemon=True)
            self._reaching.append(reach)
            reach.start()
            if self._wants_mirror:
                self._mirror = self._new_mirror(address, secret)
        for closing in (old, old_mirror):
            if closing is not None:
                closing.close()

    def host(self) -> tuple[str, bytes]:
        """Run this engine's own cache server (no ``server`` configured: the store lives in
        the worker's process) and use it; returns its address and the secret that the
        engine's other side needs to connect (never logged)."""
        self._embedded = embedded_server(self.config)
        assert self._embedded.config.secret is not None
        self.connect(self._embedded.address, self._embedded.config.secret)
        return self._embedded.address, self._embedded.config.secret

    # -- keys and lookups (the scheduler's side) -----------------------------------------

    def keys(self, token_ids: Sequence[int], extra: bytes = b"") -> list[BlockKey]:
        """One key per full block of ``token_ids``, chained from the first token;
        ``extra`` (an adapter, a cache salt) is mixed into every one."""
        return prefix_hashes(token_ids, self.block_tokens, namespace=self.namespace, extra=extra)

    def named(self, names: Sequence[str]) -> list[BlockKey]:
        """Keys for blocks the engine names itself (SGLang's page hashes): a keyed hash of
        each name under this namespace, so that the same name in another namespace is
        another key."""
        if not all(isinstance(name, str) for name in names):
            raise TypeError("block names must be strings")
        return [
            BlockKey(hashlib.blake2b(_utf8(name), key=self._name_key, digest_size=32).digest())
            for name in names
        ]

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """How many leading blocks can be loaded now (0 while the store is unreachable)."""
        usable = self._usable(keys)
        if not usable or not self._up():
            return 0
        started = time.perf_counter()
        try:
            hit = self._store().lookup(keys[:usable])
        except FAULTS as exc:
            self._fault("lookup", exc)
            return 0
        self.stats.lookup(usable * self.block_tokens, hit * self.block_tokens, started)
        return hit

    def mirrored(self, keys: Sequence[BlockKey]) -> int | None:
        """How many leading blocks the store holds as its event stream says (a local
        probe, no call); ``None`` without a mirror in step: ask :meth:`lookup`."""
        mirror = self._mirror
        if mirror is None or self._closed:
            return None
        started = time.perf_counter()
        usable = self._usable(keys)
        seen = mirror.leading(keys[:usable])
        if seen is not None:
            self.stats.lookup(usable * self.block_tokens, seen * self.block_tokens, started)
            self.stats.lookup_local()
        return seen

    def pin(self, keys: Sequence[BlockKey], start: int = 0) -> Lease | None:
        """Keep the blocks from eviction until :meth:`unpin` (or the store's lease TTL);
        ``None`` when one of them is gone or the store is unreachable. ``start``: the
        block index of ``keys[0]`` in its prompt (so for every call that takes one)."""
        if not keys or not self._up():
            return None
        try:
            return self._store().pin(keys, start)
        except FAULTS as exc:
            self._fault("pin", exc)
            return None

    def unpin(self, hold: Lease | None) -> None:
        """Release a pin. Skipped while the store is paused after a fault, or once the
        connection it was taken on is gone: the lease ends with its TTL anyway."""
        backend = self._backend
        if hold is None or backend is None or self._closed or self._clock() < self._down_until:
            return
        try:
            backend.unpin(hold)
        except FAULTS as exc:
            self._fault("unpin", exc)

    def mark_failed(self, keys: Sequence[BlockKey]) -> None:
        """Stop advertising ``keys`` for ``failed_key_ttl`` seconds."""
        until = self._clock() + self.config.failed_key_ttl
        with self._lock:
            for key in keys:
                self._failed[key] = until

    # -- loads and saves (the worker's side) ----------------------------------------------

    def attach(self, memory: PageLayout) -> None:
        """The engine's memory that loads and saves move blocks of; its blocks must be the
        identity's size. Registered with the store now, or when it is reached."""
        if memory.block_bytes != self.identity.block_bytes:
            raise ValueError(
                f"the engine's memory has {memory.block_bytes}-byte blocks, "
                f"its config says {self.identity.block_bytes}"
            )
        check_memory(memory)
        on_device = is_device(memory.buffers[0])
        staging = self.config.staging_bytes
        usable = pinned_bytes(staging) if on_device else staging  # pinned: a power of two
        if (self.config.staging == "always" or on_device) and usable < memory.block_bytes:
            raise ConfigError(
                f"staging_bytes {staging} holds no block of {memory.block_bytes} bytes"
                + (f" (pinned memory is a power of two: {usable} bytes)" if on_device else ""),
                setting="staging_bytes",
            )
        with self._connecting:
            self._memory = memory
            self._device = self._given_device or device_for(memory)
            if self._backend is not None:
                self._backend.attach(memory, self._device)

    def mark(self) -> object | None:
        """On the engine's thread: where its device work is now (``Device.mark``). A load
        or save given it (``after``) moves no byte before that work ran."""
        return self._device.mark()

    def load(
        self, keys: Sequence[BlockKey], at: Any, start: int = 0, *, after: object | None = None
    ) -> bool:
        """Fill the blocks at ``at`` (block ids, host indices: what the attached memory's
        ``offsets`` takes) now, once the engine's work before ``after`` (:meth:`mark`)
        ran; False (keys remembered as failed) when they cannot be."""
        return self.load_leading(keys, at, start, partial=False, after=after) == len(keys)

    def load_leading(
        self,
        keys: Sequence[BlockKey],
        at: Any,
        start: int = 0,
        *,
        partial: bool = True,
        after: object | None = None,
    ) -> int:
        """Load as many leading blocks as the store holds; returns how many were loaded.
        Blocks after one that landed bad (:class:`BlockCorrupt`) are never loaded; after
        one gone, a ``partial`` load (SGLang's) loads those before it, another (vLLM's)
        none. Raises :class:`LayoutError` (nothing moved) when ``at`` is outside the memory."""
        if not keys:
            return 0
        offsets = self._offsets(keys, at)

        def move(store: Backend, n: int) -> None:
            self._ordered(after)
            store.load(keys[:n], offsets[:n], start)

        return self._leading("load", keys, move, partial=partial)

    def _leading(
        self,
        what: str,
        keys: Sequence[BlockKey],
        move: Callable[[Backend, int], None],
        *,
        partial: bool = True,
    ) -> int:
        """``move`` the first ``n`` blocks: all of them, or when one is gone (and
        ``partial``) those before the first missing one. How many moved; 0 on a fault."""
        started = time.perf_counter()
        count = len(keys)
        try:
            if not self._up():  # paused after a fault: a miss, and no new fault
                self._load_failed(keys, partial, "paused")
                return 0
            try:
                move(self._store(), count)
            except BlockCorrupt as exc:  # landed bad: the blocks before it are whole
                count = exc.first
                self._load_failed(keys[count:], partial, "corrupt")
            except LookupError:  # a block is gone: move the ones before it
                if not partial:
                    raise
                count = self._store().lookup(keys)
                self._load_failed(keys[count:], partial, "gone")
                move(self._store(), count)
        except FAULTS as exc:
            self._load_failed(keys, partial, _lost_reason(exc))
            self._fault(what, exc)
            return 0
        self.stats.loaded(count * self.block_tokens, count * self.identity.block_bytes, started)
        return count

    def _load_failed(self, keys: Sequence[BlockKey], partial: bool, reason: str) -> None:
        """An all-or-nothing load (vLLM's) that failed is remembered, so that the engine is
        not offered the same keys again at once (no livelock); a leading-run load's
        (SGLang's) is not: its engine computes what did not load and moves on. Counted as
        hits lost, by ``reason`` (``_stats.LOST_REASONS``)."""
        if not partial:
            self.mark_failed(keys)
        self.stats.load_failed(len(keys) * self.block_tokens, reason)

    def save(
        self,
        keys: Sequence[BlockKey],
        at: Any,
        start: int = 0,
        *,
        after: object | None = None,
        lineage: Sequence[Lineage] = (),
    ) -> bool:
        """Store the blocks at ``at`` (those the store holds already are not sent) once
        the engine's work before ``after`` (:meth:`mark`: the forward that wrote them) ran;
        False when the store failed. Raises :class:`LayoutError` for a bad ``at``.
        ``lineage`` (:meth:`lineage`): what each key was hashed from, for the server's
        events (a KV-aware router indexes token ids)."""
        if not keys:
            return True
        offsets = self._offsets(keys, at)

        def move(store: Backend) -> int:
            self._ordered(after)
            return store.save(keys, offsets, start, lineage)

        return self._saved(keys, move)

    def get(self, keys: Sequence[BlockKey], out: Sequence[Any]) -> int:
        """The copying twin of :meth:`load_leading`: fill one ``block_bytes`` buffer per
        key; returns how many leading buffers were filled."""
        if not keys or not self._up():
            return 0
        return self._leading("get", keys, lambda store, n: store.get(keys[:n], out[:n]))

    def put(self, keys: Sequence[BlockKey], blocks: Sequence[Any]) -> bool:
        """The copying twin of :meth:`save`: one ``block_bytes`` buffer per key."""
        return not keys or self._saved(keys, lambda store: store.put(keys, blocks))

    def clear(self) -> bool:
        """Remove every block of this namespace from the store (those a reader holds at
        this moment stay); False when the store failed."""
        if not self._up():
            return False
        try:
            removed = self._store().clear()
        except FAULTS as exc:
            self._fault("clear", exc)
            return False
        _log.info("kvbridge cleared %d blocks of %s", removed, self.namespace.decode())
        return True

    def lineage(
        self, keys: Sequence[BlockKey], parent: BlockKey | None, token_ids: Sequence[int]
    ) -> tuple[Lineage, ...]:
        """Each key's lineage in a chain: its parent the key before it (``parent`` for the
        first), its token ids ``block_tokens`` of ``token_ids`` (one block's each); nothing
        when the token ids do not cover the keys (a caller that sends none)."""
        block = self.block_tokens
        if len(token_ids) != len(keys) * block:
            return ()
        parents = [parent, *keys[:-1]]
        return tuple(
            Lineage.of(up, token_ids[i * block : (i + 1) * block]) for i, up in enumerate(parents)
        )

    def save_later(self, jobs: Sequence[SaveJob]) -> None:
        """Queue saves; the engine keeps their source blocks until :meth:`saving` is False."""
        assert self._saver is not None, "this side of the connector does not save"
        self._saver.submit(jobs)

    def saving(self, request: str) -> bool:
        return self._saver is not None and self._saver.busy(request)

    def flush(self, requests: Sequence[str]) -> bool:
        """Wait until the queued saves of ``requests`` ran (their blocks are about to be
        overwritten). Bounded: each store call has its timeout, and after a fault the
        remaining jobs skip the store."""
        if self._saver is None:
            return True
        return self._saver.flush(requests)

    def wait_ready(self, timeout: float) -> bool:
        """Whether, within ``timeout`` seconds, the store is connected and (where the
        connector keeps one) the mirror of its keys is in step. For readiness probes and
        tests: nothing else waits for it (a lookup before then asks the server, or answers
        a miss while the server is unreachable)."""
        deadline = time.monotonic() + timeout
        with self._connecting:
            reaching, mirror = list(self._reaching), self._mirror
        for reach in reaching:
            reach.join(max(0.0, deadline - time.monotonic()))
        if self._backend is None and not self._up():
            return False
        return mirror is None or mirror.wait_ready(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop: queued saves run first; later calls answer misses without the store."""
        if self._saver is not None:
            self._saver.close()
        with self._connecting:
            self._closed = True
            backend, self._backend = self._backend, None
            mirror, self._mirror = self._mirror, None
        if mirror is not None:
            mirror.close()
        for reach in self._reaching:
            reach.join()  # within the connect timeout
        if backend is not None:
            backend.close()  # waits for the calls in flight (each within its timeout)
        if self._embedded is not None:
            self._embedded.close()

    def run_save(self, job: SaveJob) -> None:
        """Run one save here (the saver's thread runs those of :meth:`save_later`); one
        that failed counts as skipped. Its lineage is made here, off the engine's step."""
        lineage = self.lineage(job.keys, job.parent, job.token_ids)
        if not self.save(job.keys, job.block_ids, job.start, after=job.mark, lineage=lineage):
            self.stats.save_skipped(len(job.keys))

    # -- internals --------------------------------------------------------------------------

    def _ordered(self, after: object | None) -> None:
        """Before a move touches the engine's memory: this thread on the engine's device,
        and the engine's work before ``after`` done. A device error here (where a sticky
        one shows first) is :class:`StagingFailed`: that move's fault, or the device's."""
        try:
            self._device.bind()
            self._device.wait(after)
        except Exception as exc:
            raise StagingFailed(f"waiting for the engine's device work: {exc}") from exc

    def _saved(self, keys: Sequence[BlockKey], store: Callable[[Backend], int]) -> bool:
        if not self._up():
            return False
        started = time.perf_counter()
        try:
            moved = store(self._store())
        except FAULTS as exc:
            self._fault("save", exc)
            return False
        self.stats.saved(len(keys) * self.block_tokens, moved * self.identity.block_bytes, started)
        return True

    def _offsets(self, keys: Sequence[BlockKey], at: Any) -> Any:
        if self._memory is None:
            raise LayoutError("no engine memory attached")
        offsets = self._memory.offsets(at)
        if len(offsets) != len(keys):
            raise LayoutError(f"{len(keys)} key(s) for {len(offsets)} block(s)")
        return offsets

    def _usable(self, keys: Sequence[BlockKey]) -> int:
        with self._lock:
            if not self._failed:
                return len(keys)
            now = self._clock()
            for key in [k for k, until in self._failed.items() if until <= now]:
                del self._failed[key]
            for i, key in enumerate(keys):
                if key in self._failed:
                    return i
            return len(keys)

    def _up(self) -> bool:
        """Whether to ask the store now: not closed, not paused after a fault, and
        connected (a connection that failed is tried again here, after the pause)."""
        if self._closed or self._device_lost or self._clock() < self._down_until:
            return False
        return self._backend is not None or self._reach()

    def _reach(self) -> bool:
        """Connect, one attempt at a time. The state lock is not held while the server is
        dialled (up to the connect timeout): attaching the engine's memory never waits."""
        with self._dialling:
            with self._connecting:
                if self._closed or self._target is None or self._clock() < self._down_until:
                    return False
                if self._backend is not None:
                    return True
                target = self._target
            try:
                select_cuda(self._cuda)  # a UCX worker's context goes on the engine's device
                backend = self._open(*target)
                backend.lookup([_PROBE])  # the path's first-call costs, off the engine's time
            except FAULTS as exc:
                self._fault("connect", exc)
                return False
            with self._connecting:
                current = not self._closed and self._target == target
                if current:
                    if self._memory is not None:
                        backend.attach(self._memory, self._device)
                    self._backend = backend
            if not current:  # closed, or pointed elsewhere, while it dialled
                backend.close()
            return current

    def _open(self, address: str, secret: bytes | None) -> Backend:
        """The backend of ``address``: one server's, or a cluster's (an etcd URL)."""
        config = self.config
        settings: dict[str, Any] = {
            "connections": self._connections,
            "tenant": config.tenant,
            "streams": config.streams,
            "transports": config.transports,
            "staging": config.staging,
            "staging_bytes": config.staging_bytes,
            "on_staged": self.stats.staged,
            "verify": config.verify,
        }
        block_bytes, timeout = self.identity.block_bytes, config.timeout
        if address.startswith(ETCD_SCHEME):
            return ClusterBackend(
                *(address, secret, self.namespace, block_bytes, timeout),
                cluster=config.cluster_name,
                **settings,
            )
        return ServerBackend(
            *(address, secret, self.namespace, block_bytes, timeout),
            block_tokens=self._lineage_tokens,
            **settings,
        )

    def _new_mirror(self, address: str, secret: bytes | None) -> KeyMirror | ClusterMirror:
        """One server's mirror, or every member's of a cluster (as its backend lists them
        once connected)."""
        if not address.startswith(ETCD_SCHEME):
            return KeyMirror(lambda: self._mirror_client(address, secret))

        def members() -> list[str]:
            backend = self._backend
            return backend.members() if isinstance(backend, ClusterBackend) else []

        return ClusterMirror(members, lambda member: self._mirror_client(member, secret))

    def _mirror_client(self, address: str, secret: bytes | None) -> StoreClient:
        """The mirror's own client of the server (its calls never wait behind the
        connector's)."""
        config = self.config
        return StoreClient(
            address,
            block_bytes=self.identity.block_bytes,
            namespace=self.namespace,
            secret=secret,
            tenant=config.tenant,
            timeout=min(config.timeout, _MIRROR_TIMEOUT_S),
            block_tokens=self._lineage_tokens,  # it may be the namespace's first opener
        )

    def _store(self) -> Backend:
        backend = self._backend
        if backend is None:  # closed since _up()
            raise StoreClosed("the connector is closed")
        return backend

    def _fault(self, what: str, exc: BaseException) -> None:
        """Log a store fault (once per pause). One the store answered (full, too many
        requests, a block gone) concerns that call only; one it did not answer (down,
        unreachable, timed out) pauses store calls for a while."""
        if self._closed:
            return  # a call that met close(): a miss, not a fault
        if isinstance(exc, StagingFailed) and self._device.lost(exc):
            self._lose_device(exc)
            return
        unanswered = not isinstance(exc, StoreError)
        with self._lock:
            now = self._clock()
            first = now >= self._quiet_until
            self._quiet_until = (
                max(self._quiet_until, now + _RETRY_AFTER_S) if first else self._quiet_until
            )
            if unanswered:
                self._down_until = now + _RETRY_AFTER_S
        if first:
            _log.warning(
                "kvbridge %s failed (%s: %s): computing instead%s",
                what,
                type(exc).__name__,
                exc,
                f"; store calls pause for {_RETRY_AFTER_S:.0f} s" if unanswered else "",
            )
        self.stats.fault()

    def _lose_device(self, exc: StagingFailed) -> None:
        """The engine's device context is lost (a sticky CUDA error): no move can work
        again, so the connector turns itself off, saying so once (the engine meets the
        error at its own next device call)."""
        with self._lock:
            first, self._device_lost = not self._device_lost, True
        if first:
            _log.error(
                "kvbridge: the device's context is lost (%s): the connector loads and "
                "saves nothing from now on",
                exc.__cause__ or exc,
            )
        self.stats.fault()


def _utf8(name: str) -> bytes:
    """A name's bytes; a lone surrogate (no valid text has one) is kept as it is."""
    return name.encode("utf-8", "surrogatepass")


def _lost_reason(exc: BaseException) -> str:
    """Why a load that raised ``exc`` delivered nothing (``_stats.LOST_REASONS``)."""
    if isinstance(exc, BlockCorrupt):
        return "corrupt"
    if isinstance(exc, LookupError):
        return "gone"
    if isinstance(exc, LeaseExpired):
        return "lease"
    return "timeout" if isinstance(exc, TimeoutError) else "fault"
