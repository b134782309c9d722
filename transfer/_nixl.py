"""The ``nixl`` transport: one-sided reads and writes through NVIDIA NIXL, for trusted peers.

The other transports are two-sided: the target's engine receives each frame, checks it
against the region's key, mode, bounds and guard, and only then lets a byte land. Here the
initiator's NIXL agent reads and writes the target's registered memory itself (UCX RMA over
shared memory, TCP or RDMA; GPU memory as it is), and the target's CPU does nothing per op.
What that changes, and what stays:

- **Who may.** NIXL metadata (the agent's and the regions' addresses) is exchanged only in a
  signed control request (``link``) of an authenticated session; the target maps the peer's
  agent to that session (``Caller``) and forgets it when the session ends. An engine's
  metadata only says that it offers ``nixl``.
- **What is checked.** The initiator checks every op against the peer's regions (id, mode,
  bounds) before posting, as for every transport; the target cannot refuse a byte: a region's
  guard is never asked, and an initiator that skips the checks can reach any byte of any
  region the target registered. One trust domain only: a cache server refuses ``nixl``
  with tenants (``docs/ACCESS.md``).
- **Notifications.** A write's ``notify`` rides the NIXL transfer's notification, which
  NIXL delivers after the transfer's bytes landed; the target runs its notify handler (on a
  thread of its own, in arrival order) and answers with a notification back: accepted, or
  the handler's refusal and its code. The writer's batch is done only on that answer.
- **A plain write.** UCX completes a put once its source may be reused: over shared memory
  (``cma``) its bytes are in the target's memory by then, over a network they may not be.
  Where the agent's UCX may use a network (``Agent.remote_completion_late``), a write
  without ``notify`` carries a notification of its own (``_LANDED``) that the target
  answers without its handler: done means landed, on every transport.
- **Deadlines.** A batch not done by the engine's timeout is failed once NIXL let go of its
  transfers (``release_xfer_handle``). NIXL 1.5.1 cannot stop a one-sided op it posted over
  UCX TCP: a read of a frozen target, released (and its agent removed), still wrote all of
  its 64 MiB into the reader's buffer once the target ran again. Such a batch fails with
  ``StillInFlight`` and its local regions stay busy for good; over shared memory (``cma``)
  an op is done when it is posted, and nothing is left in flight.

Descriptors: each (local region, remote region) pair of a batch is one NIXL transfer built
from prepared descriptor lists (``prep_xfer_dlist`` once per region and page size, then
``make_prepped_xfer`` per batch with index arrays: numpy's for a large batch, plain
integers for a few ops, no Python per op), where every op's offsets and length are whole
pages of a size that divides them all; other batches are one transfer of descriptors made
for it (``initialize_xfer``). A batch done when posted (shared memory) is settled there and
then, never tracked: nothing wakes the progress thread for it.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import secrets
import struct
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._errors import (
    AuthenticationError,
    LocalProtocolError,
    PeerClosed,
    StillInFlight,
    TransferError,
)
from ._handle import TransferHandle
from ._nixl_agent import Agent, Progress
from ._ops import OP_DTYPE
from ._protocol import ErrorCode
from ._regions import Region
from ._sessions import Caller
from ._small import Rows

_log = logging.getLogger("kvbridge.transfer")

_NOTIFY = b"N"
_LANDED = b"L"
"""A plain write's notification where UCX may complete it before its bytes landed: the
target answers it without running its handler."""
_ANSWER = b"A"
_TOKEN = struct.Struct("!Q")
_CODE = struct.Struct("!H")

MAX_PREPPED_PAGES = 1 << 18
"""Descriptors one prepared list may hold (a region cut into pages): a 16 GiB slab in
64 KiB pages. Batches whose pages would need more go through ``initialize_xfer``."""

MIN_PREPPED_PAGE = 4096
"""The smallest page a region is cut into for a prepared list."""


@dataclass(frozen=True)
class RemoteRegion:
    """Where a peer's region lives, as its NIXL agent registered it."""

    address: int
    length: int
    device: int
    memory: str


@dataclass
class _Flight:
    """One batch in NIXL: its transfers, and the answer to its notification if it has one."""

    handle: TransferHandle
    link: NixlLink
    transfers: list[Any]
    answer_due: bool
    expired: TransferError | None = None
    error: TransferError | None = None
    cut_short: bool = False
    """Some transfer was still in progress when the flight expired: NIXL let go of it, but
    cannot stop its bytes (see ``StillInFlight``)."""


def memory_of(region: Region) -> tuple[int, int, str]:
    """A region's address, device id and NIXL memory type."""
    if region.device:
        view = region.view
        return int(view.data.ptr), int(view.device.id), "VRAM"
    if region.length == 0:
        return 0, 0, "DRAM"
    return int(np.frombuffer(region.view, np.uint8).ctypes.data), 0, "DRAM"


class NixlTransport:
    """An engine's NIXL agent: its registrations, the peers linked to it (target side), the
    links it made (initiator side), and the thread that progresses it."""

    name = "nixl"
    one_sided = True
    device_memory = True
    frame_bytes = 0

    def __init__(
        self,
        engine_name: str,
        *,
        on_notify: Callable[[Caller, bytes], None],
        session_alive: Callable[[Caller], bool],
    ) -> None:
        self._agent = Agent(f"{engine_name}-{secrets.token_hex(6)}")
        self._on_notify = on_notify
        self._session_alive = session_alive
        self._registered: dict[int, tuple[Any, tuple[int, int, str]]] = {}
        self._linked: dict[tuple[str, int], Caller] = {}  # the target's: (agent, session)
        self._loaded: Counter[str] = Counter()  # peers' agents loaded: links of each
        self._links: weakref.WeakSet[NixlLink] = weakref.WeakSet()  # the initiator's
        self._flights: dict[int, _Flight] = {}  # the initiator's: by token
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()  # the tables above (never held across an agent call)
        self._closed = False
        self._notifier = threading.Thread(
            target=self._notify_loop, name="kvbridge-nixl-notify", daemon=True
        )
        self._notes: queue.SimpleQueue[tuple[str, Caller, int, bytes | None] | None] = (
            queue.SimpleQueue()
        )
        """Notifications for the handler, in arrival order (``None`` for a plain write's)."""
        self._progress = Progress("kvbridge-nixl", self.poll, self._expecting)
        self._notifier.start()
        self._progress.start()

    def address(self) -> dict[str, Any]:
        """Nothing but the offer: the agent's metadata goes only to authenticated peers."""
        return {}

    # -- registered memory ------------------------------------------------------------------

    def register(self, region: Region) -> None:
        address, device, memory = memory_of(region)
        if region.length == 0:
            return
        agent = self._agent
        with agent.lock:
            descs = agent.nixl.register_memory([(address, region.length, device, "")], memory)
        with self._lock:
            self._registered[region.id] = (descs, (address, device, memory))

    def unregister(self, region: Region) -> None:
        with self._lock:
            entry = self._registered.pop(region.id, None)
            links = list(self._links)
        if entry is not None:
            agent = self._agent
            with agent.lock:
                for link in links:
                    link.forget(region.id)
                agent.nixl.deregister_memory(entry[0])

    def regions(self, ids: list[int]) -> list[list[Any]]:
        """Where the regions ``ids`` live, for a linked peer (``[id, address, device,
        memory]`` each)."""
        with self._lock:
            return [[i, *self._registered[i][1]] for i in ids if i in self._registered]

    # -- the target's side -----------------------------------------------------------------

    def accept_link(
        self, caller: Caller, body: dict[str, Any], regions: list[int]
    ) -> dict[str, Any]:
        """A peer's ``link`` request (signed, of ``caller``'s session): load its agent,
        answer with ours, the session's serial (its notifications carry it) and where the
        regions ``regions`` live. One agent may link several sessions (an engine's peers)."""
        metadata = body.get("agent")
        if not isinstance(metadata, bytes):
            raise LocalProtocolError("a nixl link carries the peer's agent metadata")
        try:
            name = self._load(metadata)
        except Exception as exc:
            raise AuthenticationError(f"unusable nixl agent metadata: {exc}") from None
        with self._lock:
            again = (name, caller.session) in self._linked
            self._linked[name, caller.session] = caller
        if again:  # a session asking once more (its peer's regions changed)
            self._unload(name)
        self._progress.wake()  # its notifications may come now
        _log.debug("nixl: agent %r linked to session %d", name, caller.session)
        return {
            "agent": self._agent.metadata(),
            "session": caller.session,
            "regions": self.regions(regions),
        }

    def session_ended(self, caller: Caller) -> None:
        """Forget the links of ``caller``'s session: their notifications are dropped, and an
        agent no session links any more is unloaded."""
        with self._lock:
            keys = [key for key in self._linked if key[1] == caller.session]
            for key in keys:
                del self._linked[key]
        for name, _ in keys:
            self._unload(name)

    def _load(self, metadata: bytes) -> str:
        """Load a peer's agent (counted: each link loads it once, ``_unload`` lets go)."""
        agent = self._agent
        with agent.lock:
            name = _text(agent.nixl.add_remote_agent(metadata))
            self._loaded[name] += 1
        return name

    def _unload(self, name: str) -> None:
        agent = self._agent
        with agent.lock:
            self._loaded[name] -= 1
            if self._loaded[name] > 0:
                return
            del self._loaded[name]
            try:
                agent.nixl.remove_remote_agent(name)
            except Exception as exc:
                _log.debug("nixl: removing agent %r: %s", name, exc)

    # -- the initiator's side --------------------------------------------------------------

    def link(
        self, request: Callable[[dict[str, Any]], dict[str, Any]], lengths: dict[int, int]
    ) -> NixlLink:
        """Link to a peer through ``request`` (its signed ``link`` control request), for its
        regions of ``lengths`` (id: bytes, as its metadata says)."""
        metadata, session, regions = self._ask(request, lengths)
        link = NixlLink(self, self._load(metadata), session, regions)
        with self._lock:
            self._links.add(link)
        return link

    def unlink(self, link: NixlLink) -> None:
        with self._lock:
            self._links.discard(link)
        self._unload(link.agent)

    def relink(
        self,
        link: NixlLink,
        request: Callable[[dict[str, Any]], dict[str, Any]],
        lengths: dict[int, int],
    ) -> None:
        """Ask the peer again where its regions live, and load its agent's metadata again
        (a region it registered since is in it)."""
        metadata, _, link.remote = self._ask(request, lengths)
        agent = self._agent
        with agent.lock:
            agent.nixl.add_remote_agent(metadata)  # the same name: its metadata updated

    def _ask(
        self, request: Callable[[dict[str, Any]], dict[str, Any]], lengths: dict[int, int]
    ) -> tuple[bytes, int, dict[int, RemoteRegion]]:
        """One ``link`` request: the peer's agent metadata, our session's serial there, and
        where its regions of ``lengths`` live."""
        reply = request({"agent": self._agent.metadata(), "regions": list(lengths)})
        metadata, session = reply.get("agent"), reply.get("session")
        if not isinstance(metadata, bytes) or not isinstance(session, int):
            raise PeerClosed("the peer answered a nixl link without its agent")
        return metadata, session, remote_regions(reply.get("regions"), lengths)

    def post(self, flight: _Flight, token: int) -> bool:
        """Track ``flight`` (under the agent's lock, with its transfers made: the progress
        thread sees it whole); ``False`` once the transport is closed."""
        with self._lock:
            if self._closed:
                return False
            self._flights[token] = flight
        self._progress.wake()
        return True

    def _expecting(self) -> bool:
        """Whether anything can arrive: a tracked transfer, or a linked peer's notes."""
        with self._lock:
            return bool(self._flights or self._linked)

    def token(self) -> int:
        return next(self._tokens)

    def wake(self) -> None:
        self._progress.wake()

    def expire(self, token: int, error: TransferError) -> None:
        """The batch ``token`` is past its deadline: fail it once NIXL let go of it."""
        with self._lock:
            flight = self._flights.get(token)
            if flight is not None and flight.expired is None:
                flight.expired = error
        self._progress.wake()

    def fail_link(self, link: NixlLink, error: TransferError) -> None:
        """Fail every batch of ``link`` in flight (the peer is gone), each once NIXL let go
        of its transfers."""
        with self._lock:
            for flight in self._flights.values():
                if flight.link is link and flight.expired is None:
                    flight.expired = error
        self._progress.wake()

    @property
    def agent(self) -> Agent:
        return self._agent

    # -- progress ----------------------------------------------------------------------------

    def poll(self) -> bool:
        """One look at the agent: notifications, then each transfer in flight; whether
        there was any."""
        agent = self._agent
        with self._lock:
            flights = list(self._flights.items())
        with agent.lock:
            notes = agent.nixl.get_new_notifs()
            for _, flight in flights:
                _check_transfers(agent.nixl, flight)
        for peer, messages in notes.items():
            for message in messages:
                self._heard(_text(peer), bytes(message))
        for token, flight in flights:
            if not flight.transfers and not flight.answer_due:
                self.land(token, flight)
        return bool(notes or flights)

    def _heard(self, peer: str, message: bytes) -> None:
        kind, body = message[:1], message[1:]
        if kind == _ANSWER and len(body) >= _TOKEN.size + _CODE.size:
            (token,) = _TOKEN.unpack_from(body)
            (code,) = _CODE.unpack_from(body, _TOKEN.size)
            with self._lock:
                flight = self._flights.get(token)
            if flight is not None and flight.link.agent == peer:
                if code:
                    text = body[_TOKEN.size + _CODE.size :].decode(errors="replace")
                    flight.error = flight.error or TransferError(
                        f"refused by the peer: {text}", code=code
                    )
                flight.answer_due = False
            return
        caller = None
        if kind in (_NOTIFY, _LANDED) and len(body) >= 2 * _TOKEN.size:
            (session,) = _TOKEN.unpack_from(body)
            with self._lock:
                caller = self._linked.get((peer, session))
        if caller is None:
            _log.debug("nixl: dropped a notification from %r (not a linked session's)", peer)
            return
        (token,) = _TOKEN.unpack_from(body, _TOKEN.size)
        self._notes.put((peer, caller, token, None if kind == _LANDED else body[2 * _TOKEN.size :]))

    def land(self, token: int, flight: _Flight) -> None:
        """The flight is over: settle its batch (once)."""
        with self._lock:
            if self._flights.pop(token, None) is None:
                return
        self.settle(flight)

    def settle(self, flight: _Flight) -> None:
        """Settle the batch of a flight that is over (and no longer tracked)."""
        error = flight.error or flight.expired
        if flight.cut_short and error is not None:
            error = StillInFlight(
                f"{error}; NIXL could not stop it: its bytes may still land later, and its "
                "local regions stay busy"
            )
        if error is not None:
            flight.handle.fail(error)
        else:
            flight.handle.part_done()

    # -- the target's notify handler -------------------------------------------------------

    def _notify_loop(self) -> None:
        while True:
            item = self._notes.get()
            if item is None:
                return
            peer, caller, token, message = item
            code, text = (0, "") if message is None else self._handle(caller, message)
            answer = _ANSWER + _TOKEN.pack(token) + _CODE.pack(code) + text.encode()
            agent = self._agent
            with agent.lock:
                try:
                    agent.nixl.send_notif(peer, answer)
                except Exception as exc:  # the peer's agent is gone: its batch fails there
                    _log.debug("nixl: cannot answer %r: %s", peer, exc)

    def _handle(self, caller: Caller, message: bytes) -> tuple[int, str]:
        from ._streams import NotifyRefused  # noqa: PLC0415 - the streams need no nixl

        if not self._session_alive(caller):
            return ErrorCode.AUTHENTICATION, "the session ended"
        try:
            self._on_notify(caller, message)
        except NotifyRefused as exc:
            return exc.code, str(exc)
        except Exception as exc:
            _log.exception("notification handler failed")
            return ErrorCode.INTERNAL, f"internal error: {exc}"
        return 0, ""

    # -- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._notes.put(None)
        self._notifier.join()
        self._progress.close()
        with self._lock:
            flights, self._flights = list(self._flights.values()), {}
        agent = self._agent
        with agent.lock:
            for flight in flights:
                for transfer in flight.transfers:
                    _release(agent.nixl, transfer)
        for flight in flights:
            flight.handle.fail(PeerClosed("the engine is closing"))
        with self._lock:
            registered, self._registered = list(self._registered.values()), {}
        with agent.lock:
            for descs, _ in registered:
                agent.nixl.deregister_memory(descs)


def _check_transfers(nixl: Any, flight: _Flight) -> None:
    """Under the agent's lock: drop each finished transfer of ``flight``; an expired one is
    released (NIXL aborts it) and counts as failed."""
    left = []
    for transfer in flight.transfers:
        try:
            state = nixl.check_xfer_state(transfer)
        except Exception as exc:  # NIXL raises some failures (a peer disconnected)
            _log.debug("nixl: a transfer failed: %s", exc)
            state = "ERR"
        if state == "PROC" and flight.expired is None:
            left.append(transfer)
            continue
        if state == "PROC":
            flight.cut_short = True
        if state == "ERR":
            flight.error = flight.error or PeerClosed("the nixl transfer failed (peer gone?)")
        if not _release(nixl, transfer):
            left.append(transfer)  # NIXL cannot let go of it yet: look again
    flight.transfers = left
    if flight.expired is not None and not left:
        flight.answer_due = False


def _release_dlist(nixl: Any, prepped: Any) -> None:
    try:
        nixl.release_dlist_handle(prepped)
    except Exception as exc:
        _log.debug("nixl: releasing a prepared list: %s", exc)


def _release(nixl: Any, transfer: Any) -> bool:
    try:
        nixl.release_xfer_handle(transfer)
    except Exception as exc:
        _log.debug("nixl: a transfer not released yet: %s", exc)
        return False
    return True


def remote_regions(body: Any, lengths: dict[int, int]) -> dict[int, RemoteRegion]:
    """The regions a ``link`` answer names, each of the length the peer's metadata says."""
    if not isinstance(body, list):
        raise PeerClosed("the peer answered a nixl link without its regions")
    regions = {}
    try:
        for key, address, device, memory in body:
            if int(key) in lengths:
                length = lengths[int(key)]
                regions[int(key)] = RemoteRegion(int(address), length, int(device), str(memory))
    except (TypeError, ValueError) as exc:
        raise PeerClosed(f"the peer answered a nixl link with bad regions: {exc}") from None
    return regions


class NixlLink:
    """The initiator's one-sided path to one peer: its agent, its regions, the prepared
    descriptor lists, and the batches posted through it."""

    def __init__(
        self,
        transport: NixlTransport,
        agent: str,
        session: int,
        regions: dict[int, RemoteRegion],
    ) -> None:
        self._transport = transport
        self._nixl = transport.agent.nixl
        self._lock = transport.agent.lock
        self.agent = agent
        self._session = _TOKEN.pack(session)
        self.remote = regions
        self._prepped: dict[tuple[str, int, int], Any] = {}

    def submit(
        self,
        ops: Rows | np.ndarray,
        local: dict[int, Region],
        access: str,
        notify: bytes | None,
        handle: TransferHandle,
    ) -> int | None:
        """Post the batch ``ops`` (checked: every op inside its regions) as NIXL transfers;
        the token the flight is known by, or ``None`` when it is over already (moved as it
        was posted, or failed to post). Only a flight with something left to wait for is
        tracked: one moved at once never wakes the progress thread."""
        transport = self._transport
        token = transport.token()
        landed = notify is None and access == "w" and transport.agent.remote_completion_late
        flight = _Flight(handle, self, [], notify is not None or landed)
        message = b""
        if notify is not None:
            message = _NOTIFY + self._session + _TOKEN.pack(token) + notify
        elif landed:
            message = _LANDED + self._session + _TOKEN.pack(token)
        operation = "WRITE" if access == "w" else "READ"
        groups = _groups(ops)
        with self._lock:
            try:
                for index, part in enumerate(groups):
                    last = index == len(groups) - 1
                    transfer = self._make(operation, part, local, message if last else b"")
                    flight.transfers.append(transfer)
                tracked = flight.answer_due  # tracked first: its answer may come at once
                if tracked and not transport.post(flight, token):
                    raise PeerClosed("the nixl transport is closed")
                if not groups and message:
                    self._nixl.send_notif(self.agent, message)
                flight.transfers = [t for t in flight.transfers if not self._post(t)]
                if not flight.transfers and not flight.answer_due:
                    transport.settle(flight)
                    return None
                if not tracked and not transport.post(flight, token):
                    raise PeerClosed("the nixl transport is closed")
            except Exception as exc:
                error = exc if isinstance(exc, TransferError) else PeerClosed(f"nixl: {exc}")
                flight.error = flight.error or error
                flight.answer_due = False
                if not transport.post(flight, token):  # else the progress thread fails it
                    for transfer in flight.transfers:
                        _release(self._nixl, transfer)
                    handle.fail(error)
        return token

    def _post(self, transfer: Any) -> bool:
        """Start ``transfer``; whether it is done already (then it is released)."""
        state = str(self._nixl.transfer(transfer))
        if state == "ERR":
            raise PeerClosed("the nixl transfer failed at once (peer gone?)")
        if state == "DONE":
            _release(self._nixl, transfer)
            return True
        return False

    def _make(
        self, operation: str, ops: Rows | np.ndarray, local: dict[int, Region], message: bytes
    ) -> Any:
        """One NIXL transfer of ``ops`` (all between one local and one remote region):
        prepared lists by page index where every offset and length is whole pages."""
        if isinstance(ops, list):
            local_region, remote_id = local[ops[0][0]], ops[0][2]
        else:
            local_region = local[int(ops["local_region"][0])]
            remote_id = int(ops["remote_region"][0])
        remote = self.remote.get(remote_id)
        if remote is None:
            raise LocalProtocolError(f"the peer's nixl agent has no region {remote_id}")
        longest = max(local_region.length, remote.length)
        pages = _few_indices(ops, longest) if isinstance(ops, list) else _indices(ops, longest)
        if pages is not None:
            page, mine_idx, their_idx = pages
            mine = self._prepped_side("", local_region.id, page, local_region)
            theirs = self._prepped_side(self.agent, remote_id, page, remote)
            return self._nixl.make_prepped_xfer(
                operation, mine, mine_idx, theirs, their_idx, message
            )
        array = np.array(ops, OP_DTYPE) if isinstance(ops, list) else ops
        address, device, memory = memory_of(local_region)
        mine_descs = _descs(address, device, array["local_offset"], array["length"])
        their_descs = _descs(remote.address, remote.device, array["remote_offset"], array["length"])
        return self._nixl.initialize_xfer(
            operation,
            self._nixl.get_xfer_descs(mine_descs, memory),
            self._nixl.get_xfer_descs(their_descs, remote.memory),
            self.agent,
            message,
        )

    def _prepped_side(
        self, agent: str, region_id: int, page: int, where: Region | RemoteRegion
    ) -> Any:
        """The prepared list of region ``region_id`` cut into ``page``-byte pages (under the
        agent's lock)."""
        key = (agent, region_id, page)
        prepped = self._prepped.get(key)
        if prepped is None:
            if isinstance(where, Region):
                address, device, memory = memory_of(where)
                length = where.length
            else:
                address, device, memory, length = (
                    where.address,
                    where.device,
                    where.memory,
                    where.length,
                )
            count = length // page
            descs = _descs(
                address,
                device,
                np.arange(count, dtype=np.uint64) * page,
                np.full(count, page, np.uint64),
            )
            prepped = self._nixl.prep_xfer_dlist(agent or "NIXL_INIT_AGENT", descs, memory)
            self._prepped[key] = prepped
        return prepped

    def progress(self) -> bool:
        """One poll of the agent (a waiting caller drives its batch with it)."""
        return self._transport.poll()

    def expire(self, token: int, error: TransferError) -> None:
        """The batch ``token`` is past its deadline (see ``NixlTransport.expire``)."""
        self._transport.expire(token, error)

    def fail_all(self, error: TransferError) -> None:
        self._transport.fail_link(self, error)

    def forget(self, region_id: int) -> None:
        """Release the prepared lists of local region ``region_id`` (it is unregistered;
        under the agent's lock)."""
        for key in [k for k in self._prepped if k[0] == "" and k[1] == region_id]:
            _release_dlist(self._nixl, self._prepped.pop(key))

    def close(self) -> None:
        with self._lock:
            for prepped in self._prepped.values():
                _release_dlist(self._nixl, prepped)
            self._prepped.clear()
        self._transport.unlink(self)


def _groups(ops: Rows | np.ndarray) -> Sequence[Rows | np.ndarray]:
    """The batch's ops by (local region, remote region): one NIXL transfer each."""
    if len(ops) <= 1:
        return [ops] if len(ops) else []
    if isinstance(ops, list):
        by_pair: dict[tuple[int, int], Rows] = {}
        for row in ops:
            by_pair.setdefault((row[0], row[2]), []).append(row)
        return list(by_pair.values())
    local, remote = ops["local_region"], ops["remote_region"]
    if (local == local[0]).all() and (remote == remote[0]).all():
        return [ops]
    pairs = local.astype(np.uint64) << np.uint64(32) | remote.astype(np.uint64)
    return [ops[pairs == pair] for pair in np.unique(pairs)]


def _page(unit: int, longest: int) -> int:
    """The page size of a batch whose offsets and lengths have ``unit`` as their greatest
    common divisor, over regions of at most ``longest`` bytes (0: no prepared list)."""
    if unit < MIN_PREPPED_PAGE or longest // unit > MAX_PREPPED_PAGES:
        return 0
    return unit


_Pages = tuple[int, np.ndarray, np.ndarray]
"""A batch as prepared-list indices: the page size, the local and the remote page indices."""


def _few_indices(rows: Rows, longest: int) -> _Pages | None:
    """A few ops' page indices, in plain integers (numpy's calls cost more than the work)."""
    page = _page(math.gcd(*[v for row in rows for v in (row[1], row[3], row[4])]), longest)
    if not page:
        return None
    mine = [i for r in rows for i in range(r[1] // page, (r[1] + r[4]) // page)]
    theirs = [i for r in rows for i in range(r[3] // page, (r[3] + r[4]) // page)]
    return page, np.array(mine, np.int32), np.array(theirs, np.int32)


def _indices(ops: np.ndarray, longest: int) -> _Pages | None:
    """A batch's page indices: its one op length where every offset is a multiple of it
    (engine pages: a few numpy calls), else the greatest common divisor of them all."""
    offsets, lengths = (ops["local_offset"], ops["remote_offset"]), ops["length"]
    length = int(lengths[0])
    if (lengths == length).all() and not any((o % length).any() for o in offsets):
        page = _page(length, longest)
        if not page:
            return None
        return page, (offsets[0] // page).astype(np.int32), (offsets[1] // page).astype(np.int32)
    unit = math.gcd(*(int(np.gcd.reduce(c.astype(np.int64))) for c in (*offsets, lengths)))
    page = _page(unit, longest)
    if not page:
        return None
    counts = lengths // page
    return page, _pages(offsets[0] // page, counts), _pages(offsets[1] // page, counts)


def _pages(first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The page indices of ops starting at page ``first`` and ``counts`` pages long."""
    first = first.astype(np.int64)
    counts = counts.astype(np.int64)
    if (counts == 1).all():
        return first.astype(np.int32)
    starts = np.repeat(first - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
    return (starts + np.arange(int(counts.sum()))).astype(np.int32)


def _descs(address: int, device: int, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    descs = np.empty((len(offsets), 3), np.uint64)
    descs[:, 0] = np.uint64(address) + offsets.astype(np.uint64)
    descs[:, 1] = lengths
    descs[:, 2] = device
    return descs


def _text(name: Any) -> str:
    """An agent name as NIXL gives it (bytes from ``add_remote_agent``, str elsewhere)."""
    return name.decode() if isinstance(name, bytes) else str(name)
