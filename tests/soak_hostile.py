"""The soak test's hostile neighbour: hello floods, slow-loris data connections and late
writes, from threads of the test process."""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable

import msgpack
import zmq
from attack import RawStream, data_address, descriptors, raw, region_key
from soak_common import (
    BB,
    CLIENT_TIMEOUT_S,
    CONVERSATIONS,
    LEASE_TTL,
    LORIS_CONNECTIONS,
    LORIS_MAX_AGE_S,
    NAMESPACES,
    block_key,
)

from kvbridge.store import (
    LeaseExpired,
    StoreClient,
    StoreFull,
    TooManyRequests,
)
from kvbridge.transfer._control import CONTROL_VERSION
from kvbridge.transfer._events import Ack
from kvbridge.transfer._protocol import Connection, Role
from kvbridge.transfer._sessions import HELLO_BYTES

# -- the hostile neighbour (threads of the test process) ---------------------------------


class _Hostile:
    """Hello floods, slow-loris connections and late writes, until ``stop`` is set."""

    def __init__(self, address: str, seed: int) -> None:
        self.address = address
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []
        self.violations: list[str] = []
        self.loris_max_age = 0.0
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._guarded, args=(fn,), name=fn.__name__, daemon=True)
            for fn in (self._flood, self._loris, self._late_writes, self._late_writes)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def close(self) -> list[str]:
        """Stop and join; the names of threads that did not stop."""
        self.stop.set()
        started = [t for t in self._threads if t.ident is not None]
        for thread in started:
            thread.join(60)
        return [t.name for t in started if t.is_alive()]

    def count(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.counts[what] += n

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:
            with self._lock:
                self.errors.append(f"{fn.__name__}: {type(exc).__name__}: {exc}")

    def _flood(self) -> None:
        """Unauthenticated hellos by the hundred, from a fresh socket now and then."""
        context = zmq.Context()
        try:
            while not self.stop.is_set():
                sock = context.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.connect(f"tcp://{self.address}")
                try:
                    for _ in range(10):
                        for _ in range(200):
                            hello = {
                                "op": "hello",
                                "v": CONTROL_VERSION,
                                "name": "flood",
                                "nonce": os.urandom(16),
                            }
                            sock.send_multipart([b"", msgpack.packb(hello)])
                        self.count("hellos", 200)
                        while sock.poll(0):
                            sock.recv_multipart()
                            self.count("hello_answers")
                        if self.stop.wait(0.25):
                            break
                finally:
                    sock.close()
        finally:
            context.term()

    def _loris(self) -> None:
        """Data connections that send a stream HELLO one byte a second."""
        frame = Connection(Role.INITIATOR).hello(os.urandom(HELLO_BYTES), 0)
        host, port = self._data_address()
        conns: list[tuple[socket.socket, float, int]] = []
        try:
            while not self.stop.is_set():
                while len(conns) < LORIS_CONNECTIONS:
                    try:
                        sock = socket.create_connection((host, port), timeout=5)
                    except OSError:
                        self.count("loris_connect_failed")
                        break
                    conns.append((sock, time.monotonic(), 0))
                    self.count("loris_connections")
                alive = []
                for sock, opened, sent in conns:
                    age = time.monotonic() - opened
                    if _closed_by_peer(sock):
                        sock.close()
                        self.count("loris_closed_by_server")
                        self.loris_max_age = max(self.loris_max_age, age)
                        continue
                    if age > LORIS_MAX_AGE_S:
                        self.violations.append(f"a slow-loris connection lived {age:.1f} s")
                        sock.close()
                        continue
                    try:
                        sock.sendall(frame[sent % len(frame) : sent % len(frame) + 1])
                    except OSError:
                        sock.close()
                        self.count("loris_closed_by_server")
                        self.loris_max_age = max(self.loris_max_age, age)
                        continue
                    alive.append((sock, opened, sent + 1))
                conns = alive
                self.stop.wait(1.0)
        finally:
            for sock, _, _ in conns:
                sock.close()

    def _data_address(self) -> tuple[str, int]:
        with StoreClient(self.address, block_bytes=BB, namespace=NAMESPACES[0]) as client:
            address = data_address(client)
            return str(address["host"]), int(address["port"])

    def _late_writes(self) -> None:
        """Stage, start a write, send part of it, end the lease (abort, or let it expire),
        send the rest later; then try to commit the expired one (must be refused)."""
        client: StoreClient | None = None
        try:
            while not self.stop.is_set():
                if client is None or self.rng.random() < 0.1:
                    if client is not None:
                        client.close()
                    ns = self.rng.choice(NAMESPACES)
                    client = StoreClient(
                        self.address, block_bytes=BB, namespace=ns, timeout=CLIENT_TIMEOUT_S
                    )
                try:
                    self._late_write(client, ns)
                except (StoreFull, TooManyRequests):
                    self.count("late_refused")
                except Exception as exc:
                    self.count(f"late_error:{type(exc).__name__}")
                    client.close()
                    client = None
                self.stop.wait(self.rng.uniform(0.1, 0.5))
        finally:
            if client is not None:
                client.close()

    def _late_write(self, client: StoreClient, ns: str) -> None:
        keys = [block_key(ns, self.rng.randrange(CONVERSATIONS), i) for i in range(2)]
        reply = raw(client).op("stage", keys=keys)
        lease, slots = int(reply["lease"]), [s for s in reply["slots"] if s is not None]
        if not lease or not slots:
            return
        stream = RawStream(client)
        try:
            ops = descriptors(
                raw(client).region,
                region_key(client, raw(client).region),
                [(s * BB, BB) for s in slots],
            )
            stream.start_write(ops)
            total = len(slots) * BB
            first = self.rng.randrange(1, total)
            stream.send(b"\xaa" * first)
            time.sleep(0.2)  # admitted: the server waits for the rest
            ending = self.rng.choice(["abort", "expire"])
            if ending == "abort":
                raw(client).op("abort", lease=lease)
            else:
                time.sleep(LEASE_TTL + 0.3)
            time.sleep(self.rng.uniform(0.2, 2.0))  # others reuse slots meanwhile
            stream.send(b"\xaa" * (total - first))
            answer = stream.event()
            self.count("late_writes")
            self.count("late_acked" if isinstance(answer, Ack) else "late_refused_by_stream")
        finally:
            stream.close()
        if ending == "expire":
            try:
                raw(client).op("commit", lease=lease)
            except LeaseExpired:
                self.count("late_commits_refused")
            else:
                self.violations.append("a commit of late 0xAA bytes after expiry was accepted")


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
