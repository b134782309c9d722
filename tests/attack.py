"""What a hostile or broken client can do on the wire, below StoreClient's good manners.

``RawStream`` opens a data stream with a session's real credentials (as the client itself,
or as someone who stole them) and sends frames by hand: a write whose payload arrives in
pieces, as late as it likes; a read of any region and offset; a read whose answer it never
takes. It speaks the client's transport: TCP, or UCX (where a payload goes op by op).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
from collections.abc import Iterator, Sequence
from typing import Any

import msgpack
import numpy as np
import zmq

from kvbridge.store import StoreClient, Subscription
from kvbridge.transfer import OP_DTYPE, Peer, Region, TransferEngine
from kvbridge.transfer._control import CONTROL_VERSION
from kvbridge.transfer._events import Data, Event
from kvbridge.transfer._nixl import NixlTransport
from kvbridge.transfer._pipes import Pipe, SocketPipe
from kvbridge.transfer._protocol import DESCRIPTOR, Connection, Role
from kvbridge.transfer._sessions import Credentials
from kvbridge.transfer._streams import next_event
from kvbridge.transfer._ucx import UcxPipe, message_runs

_IDS = itertools.count(1 << 40)


def descriptors(region: int, key: int, spans: list[tuple[int, int]]) -> np.ndarray:
    ops = np.zeros(len(spans), dtype=DESCRIPTOR)
    ops["region"], ops["key"] = region, key
    ops["offset"] = [offset for offset, _ in spans]
    ops["length"] = [length for _, length in spans]
    return ops


def region_key(client: StoreClient, region: int) -> int:
    """A region's access key as the server's metadata lists it (every session sees it)."""
    return client.peer.refresh()[region].key


class RawStream:
    """A data stream to ``client``'s server in ``client``'s session, driven by hand, over the
    transport ``client`` uses: a socket over TCP (``sock``), a UCX pipe opened by the
    client's own engine over UCX (``sock`` is None)."""

    def __init__(self, client: StoreClient, index: int = 7, *, greeted: bool = True) -> None:
        """``greeted``: wait for the server's answer to the HELLO (an ACK); ``False``
        leaves it to :meth:`event` (a refusal, say)."""
        peer = client.peer
        session = credentials(peer)
        address = peer_transports(peer)[peer.transport]
        self.sock: socket.socket | None = None
        self.pipe: Pipe
        if peer.transport == "tcp":
            self.sock = socket.create_connection((address["host"], address["port"]), timeout=10)
            self.pipe = SocketPipe(self.sock)
        else:
            self.pipe = peer._transport.open(address, 10)
        self.conn = Connection(Role.INITIATOR)
        self.pipe.send([self.conn.hello(session.hello(index), index)])
        if greeted:
            self.event()  # ACK

    def event(self) -> Event:
        return next_event(self.conn, self.pipe)

    def start_write(self, ops: np.ndarray) -> int:
        """Send a WRITE's header and descriptors only; the payload follows with ``send``."""
        request = next(_IDS)
        self.pipe.send([self.conn.write(request, ops)])
        return request

    def start_read(self, ops: np.ndarray) -> int:
        """Send a READ and leave its answer unread (``event`` reads its header)."""
        request = next(_IDS)
        self.pipe.send([self.conn.read(request, ops)])
        return request

    def send(self, data: bytes) -> None:
        """Payload bytes, as late as the caller likes. Over TCP any piece of a frame's
        payload; over UCX one message, which the server takes for one op's whole payload
        (ops of 64 KiB or more; smaller ones travel packed, a run per message): send a
        payload op by op there."""
        if self.sock is not None:
            self.sock.sendall(data)
        else:
            one_message(self.pipe, data)

    def send_payload(self, data: bytes, lengths: Sequence[int]) -> None:
        """A whole payload of ops of ``lengths``, cut as the client's engine cuts it: over
        UCX small ops travel packed in runs, a message each; over TCP one piece."""
        start = 0
        for first, end in message_runs(list(lengths)):
            size = sum(lengths[first:end])
            self.send(data[start : start + size])
            start += size

    def read(self, ops: np.ndarray) -> tuple[Event, bytes]:
        """A READ; returns the answer and, for DATA, the payload."""
        self.start_read(ops)
        answer = self.event()
        if not isinstance(answer, Data):
            return answer, b""
        lengths: list[int] = ops["length"].tolist()
        payload = bytearray(sum(lengths))
        whole, start, views = memoryview(payload), 0, []
        for length in lengths:  # one view per op: UCX moves each op as its own message
            views.append(whole[start : start + length])
            start += length
        self.pipe.recv_into_views(views)
        self.conn.payload_received()
        return answer, bytes(payload)

    def close(self) -> None:
        self.pipe.close()


def one_message(pipe: Pipe, data: bytes) -> None:
    """Post ``data`` on a UCX pipe as one message of the stream, as it is. ``UcxPipe.send``
    takes its first buffer for a frame (a header message, then the body), so a payload sent
    on its own goes through the pipe's numbering and posting directly. It returns once the
    message is posted (as ``sendall`` once the kernel has the bytes); the posted request
    keeps ``data`` alive until UCX is done with it."""
    assert isinstance(pipe, UcxPipe)
    first = pipe._numbers(1, send=True)
    pipe._post([memoryview(data)], pipe._tags(pipe._send_channel, first, 1), first)


def control_request(
    address: str, message: dict[str, Any], timeout_s: float = 5.0
) -> dict[str, Any]:
    """Send one raw control message (from a socket no session owns) and return the answer."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{address}")
        sock.send_multipart([b"", msgpack.packb({**message, "rid": 1}, use_bin_type=True)])
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("no answer")
        _, body = sock.recv_multipart()
        answer: dict[str, Any] = msgpack.unpackb(body, raw=False)
        return answer
    finally:
        sock.close()
        context.term()


def guess_auth(address: str, name: str = "mallory", principal: str = "") -> Any:
    """A handshake by someone without the secret: a real hello, then an auth whose proof is
    a guess (for ``principal``). Returns the server's answer to the auth."""
    hello = control_request(
        address,
        {
            "op": "hello",
            "v": CONTROL_VERSION,
            "name": name,
            "principal": principal,
            "nonce": bytes(16),
        },
    )
    guess = {
        "op": "auth",
        "name": name,
        "principal": principal,
        "nonce": bytes(16),
        "server_nonce": hello["nonce"],
        "ticket": hello["ticket"],
        "proof": bytes(32),
    }
    return control_request(address, guess)


class RawClient:
    """The requests a ``StoreClient`` makes, made by hand in its session: any op with any
    fields, in any order, with another namespace's handle or a lease never taken. This is
    the one place the tests reach into a client's private state (its namespace handle, its
    region, its session's credentials), on purpose: it is what an attacker holding the
    session would know."""

    def __init__(self, client: StoreClient) -> None:
        self.client = client

    @property
    def ns(self) -> int:
        """The namespace handle the server gave the client (what an attacker would guess)."""
        return int(self.client._ns)

    @property
    def region(self) -> int:
        """The id of the server region that holds the client's namespace."""
        return int(self.client._region)

    def call(self, body: dict[str, Any]) -> dict[str, Any]:
        """Send ``body`` as one request in the client's session; the server's reply (or
        its refusal, raised as the client raises it)."""
        return self.client._call(body)

    def op(self, op: str, **fields: Any) -> dict[str, Any]:
        """``call`` of ``op`` on the client's own namespace."""
        return self.call({"op": op, "ns": self.ns, **fields})


def raw(client: StoreClient) -> RawClient:
    return RawClient(client)


def credentials(peer: Peer) -> Credentials:
    """The session credentials a peer holds (what a thief of the session would hold)."""
    held = peer._credentials
    assert held is not None
    return held


def peer_transports(peer: Peer) -> dict[str, dict[str, Any]]:
    """Where the peer's engine takes data streams, per transport (its metadata)."""
    return dict(peer._info.transports)


def data_pipe(target: TransferEngine, opener: TransferEngine) -> Pipe:
    """A data stream to ``target``'s only transport, opened by hand: a socket over TCP, a
    pipe of ``opener``'s transport otherwise (over UCX each ``send`` is one message)."""
    (name,) = target._transports
    address = target._transports[name].address()
    if name == "tcp":
        return SocketPipe(socket.create_connection((address["host"], address["port"])))
    transport = opener._transports[name]
    assert not isinstance(transport, NixlTransport), "nixl opens no data streams"
    return transport.open(address, 5.0)


@contextlib.contextmanager
def region_in_use(engine: TransferEngine, region: Region) -> Iterator[None]:
    """Hold ``region`` as a transfer in flight holds it (no real transfer needed)."""
    engine._regions.acquire([region])
    try:
        yield
    finally:
        engine._regions.release([region])


def registered(engine: TransferEngine) -> int:
    """How many regions ``engine`` has registered."""
    return len(engine._regions.infos())


def write_ops(client: StoreClient, source: Region, slots: Sequence[int]) -> np.ndarray:
    """Engine ops that write whole blocks of ``source`` (block ``i`` at ``i * block_bytes``)
    into the client's namespace at ``slots``: what a put's write is, for sending by hand."""
    bb = client.block_bytes
    ops = np.zeros(len(slots), dtype=OP_DTYPE)
    ops["local_region"], ops["local_offset"] = source.id, np.arange(len(slots)) * bb
    ops["remote_region"], ops["remote_offset"] = raw(client).region, np.asarray(slots) * bb
    ops["length"] = bb
    return ops


def stage(client: StoreClient, ks: Sequence[bytes]) -> tuple[int, list[int]]:
    """Stage ``ks`` by hand (one request, no write): the lease and the slots."""
    reply = raw(client).op("stage", keys=ks)
    return int(reply["lease"]), [int(s) for s in reply["slots"]]


def abort(client: StoreClient, lease: int) -> None:
    """Give back a lease taken with :func:`stage` (one request, as the client would)."""
    raw(client).op("abort", lease=lease)


def ask_room(client: StoreClient, ks: Sequence[bytes], put: int) -> dict[str, Any]:
    """The ``room`` request a put of several requests starts with, by hand (a put that
    then never comes: its keys stay protected until its record ends)."""
    return raw(client).op("room", keys=list(ks), put=put)


def handle_of(client: StoreClient) -> int:
    """The namespace handle the server gave ``client`` (what an attacker would guess)."""
    return raw(client).ns


def data_address(client: StoreClient, transport: str = "tcp") -> dict[str, Any]:
    """Where ``client``'s server takes data streams over ``transport`` (its metadata)."""
    return peer_transports(client.peer)[transport]


def slot_ops(client: StoreClient, slots: list[int], region: int | None = None) -> np.ndarray:
    """Descriptors of whole blocks at ``slots`` of ``region`` (the client's namespace by
    default), with the region's real key."""
    region = raw(client).region if region is None else region
    bb = client.block_bytes
    return descriptors(region, region_key(client, region), [(s * bb, bb) for s in slots])


def unread_subscriber(sub: Subscription) -> zmq.Socket[bytes]:
    """An events subscriber as an attacker runs it, built on the wire by hand: its ticket
    from a routing id it chose, and then nothing read. Its own side holds one message and
    the smallest receive buffer, so what the server sends it waits on the server."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVHWM, 1)
    socket.setsockopt(zmq.RCVBUF, 4096)
    socket.setsockopt(zmq.ROUTING_ID, b"\x01" + os.urandom(15))
    socket.connect(sub.endpoint)
    socket.send(sub.request)
    return socket


def nixl_notify(engine: TransferEngine, peer: Peer, session: int, message: bytes) -> None:
    """Send ``peer``'s engine a raw NIXL notification from ``engine``'s agent, naming the
    target's session serial ``session`` (an agent claiming another session's link)."""
    nixl = engine._transports["nixl"]
    link = peer._link
    assert isinstance(nixl, NixlTransport) and link is not None
    body = b"N" + session.to_bytes(8, "big") + (1).to_bytes(8, "big") + message
    with nixl.agent.lock:
        nixl.agent.nixl.send_notif(link.agent, body)


def nixl_session(peer: Peer) -> int:
    """The target's serial of ``peer``'s session, as its nixl link carries it."""
    link = peer._link
    assert link is not None
    return int.from_bytes(link._session, "big")
