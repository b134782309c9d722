"""Soak: a real ``kvbridge serve`` under churn, with clients that die and a hostile neighbour.

For ``KVBRIDGE_SOAK_S`` seconds (60 by default) eight worker processes put prefixes of
blocks and read back blocks that they or others put, in two namespaces of a server whose
memory holds 64 blocks per namespace (eviction and slot reuse never stop) and whose leases
last 2 s. At random a worker closes its client in the middle of a put, or stalls until its
lease expired before it commits or releases (the server must refuse: ``LeaseExpired``); the
driver SIGKILLs a random worker every few seconds and starts a new one. Meanwhile the test
process floods the control port with unauthenticated hellos, holds slow-loris connections
on the data port, and sends late writes (a write admitted under a lease whose bytes arrive
after the lease was aborted or expired).

Every block's bytes are a pure function of its key and namespace, so every reader checks
every byte it reads. What must hold:

(a) no reader ever gets a wrong byte (a miss is fine);
(b) every block whose put returned normally is readable with its bytes afterwards (the
    server has a disk tier larger than every key the workers can ever write, and write
    through: the store never has to drop a committed block);
(c) the server's threads and memory come back to where they were once every client left;
(d) the server is alive, answers ``kvbridge stats``, and holds no lease once every client
    left; its stderr has no traceback.

``KVBRIDGE_SOAK_S`` sets the duration and ``KVBRIDGE_SOAK_SEED`` the driver's seed (printed
with the summary; the workers' seeds derive from it). Run with ``-s`` to see the summary.
A worker is this file run as a script (``python tests/test_soak.py worker CONFIG``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import msgpack
import numpy as np
import pytest
import zmq
from attack import RawStream, descriptors, region_key

from kvbridge.store import (
    BlockKey,
    BlockNotFound,
    InternalError,
    LeaseExpired,
    StoreClient,
    StoreFull,
    TooManyRequests,
)
from kvbridge.tools._serve_cmds import read_listening, server_stats
from kvbridge.transfer import OP_DTYPE, TransferError
from kvbridge.transfer._control import CONTROL_VERSION
from kvbridge.transfer._protocol import Ack, Connection, Role
from kvbridge.transfer._sessions import HELLO_BYTES

BB = 64 << 10
NAMESPACES = ("soak-a", "soak-b")
HOST_CAPACITY = 8 << 20
"""64 blocks per namespace (the server splits it between ``--max-namespaces 2``)."""
LEASE_TTL = 2.0
CONVERSATIONS = 2048
BLOCKS = 16
"""Keys of a namespace: prefixes of ``CONVERSATIONS`` conversations of ``BLOCKS`` blocks
(32768 keys, 2 GiB): enough that puts keep sending new blocks for the whole run."""
DISK_CAPACITY = 2 * len(NAMESPACES) * CONVERSATIONS * BLOCKS * BB
"""Twice every key the workers can write (each namespace gets half): the disk tier never
evicts, so a committed block can never legitimately leave the store."""
WORKERS = 8
CLIENT_TIMEOUT_S = 10.0
KILL_EVERY_S = (2.0, 4.0)
STOP_GRACE_S = 30.0
"""How long workers get, past the deadline, to finish their operation and exit."""
SETTLE_S = 30.0
"""How long the server's threads get, once every client left, to end (a slow-loris
connection's thread ends at the 10 s handshake deadline at the latest)."""
LEASES_GONE_S = 5.0
"""How long the server gets, once every client left, to hold no lease."""
RSS_SLACK_BYTES = 64 << 20
LORIS_CONNECTIONS = 16
LORIS_MAX_AGE_S = 20.0
"""The server's handshake deadline is 10 s (connect_timeout): a slow-loris connection that
lives much longer than that holds a serving thread without a deadline."""


def soak_seconds() -> float:
    return float(os.environ.get("KVBRIDGE_SOAK_S", "60"))


# -- keys and bytes: pure functions of (namespace, conversation, block) -------------------


def block_key(ns: str, conversation: int, block: int) -> BlockKey:
    text = f"{ns}/{conversation}/{block}".encode()
    return BlockKey(hashlib.blake2b(text, digest_size=32).digest())


def prefix(ns: str, conversation: int, length: int) -> list[BlockKey]:
    return [block_key(ns, conversation, i) for i in range(length)]


def block_bytes(key: bytes) -> np.ndarray:
    """The only bytes ever committed under ``key``: blake2b(key) expanded by PCG64."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=16).digest(), "little")
    generator = np.random.Generator(np.random.PCG64(seed))
    return np.frombuffer(generator.bytes(BB), dtype=np.uint8)


def blocks_of(keys: list[BlockKey]) -> np.ndarray:
    out = np.empty((len(keys), BB), dtype=np.uint8)
    for row, key in zip(out, keys, strict=True):
        row[:] = block_bytes(key)
    return out


def wrong_bytes(keys: list[BlockKey], out: np.ndarray) -> list[tuple[int, int]]:
    """(index, wrong byte count) of each block of ``out`` that is not its key's bytes."""
    bad = []
    for i, key in enumerate(keys):
        wrong = int(np.count_nonzero(out[i] != block_bytes(key)))
        if wrong:
            bad.append((i, wrong))
    return bad


# -- the worker (a separate process) -----------------------------------------------------


class _Worker:
    """One client process. Everything the test needs afterwards goes to its log as it
    happens (one ``os.write`` per line, so a SIGKILL loses nothing already reported):

    ``C [ns, conversation, length]``: a put of that prefix returned normally;
    ``W {...}``: a block read with wrong bytes; ``B {...}``: the server accepted what it
    must refuse (a commit or read past its lease) or a call hung; ``L {...}``: a prefix
    this worker committed is no longer all in the store; ``X {...}``: an unexpected
    exception; ``S {...}``: the counters so far.
    """

    def __init__(self, config: dict[str, Any]) -> None:
        self.address: str = config["address"]
        self.deadline: float = config["deadline"]
        self.stop = Path(config["stop"])
        self.rng = random.Random(config["seed"])
        self.fd = os.open(config["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.counts: Counter[str] = Counter()
        self.clients: dict[str, StoreClient] = {}
        self.committed: list[tuple[str, int, int]] = []

    def emit(self, kind: str, payload: Any) -> None:
        os.write(self.fd, f"{kind} {json.dumps(payload)}\n".encode())

    def client(self, ns: str) -> StoreClient:
        client = self.clients.get(ns)
        if client is None:
            client = StoreClient(self.address, block_bytes=BB, namespace=ns, timeout=10.0)
            self.clients[ns] = client
        return client

    def drop(self, ns: str | None = None) -> None:
        for name in [ns] if ns is not None else list(self.clients):
            client = self.clients.pop(name, None)
            if client is not None:
                try:
                    client.close()
                except Exception as exc:
                    self.unexpected("close", exc)

    def unexpected(self, op: str, exc: BaseException) -> None:
        self.counts[f"unexpected:{type(exc).__name__}"] += 1
        self.emit("X", {"op": op, "type": type(exc).__name__, "error": str(exc)[:300]})

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> int:
        ops: list[tuple[float, Callable[[], None]]] = [
            (0.38, self.put),
            (0.36, self.get_prefix),
            (0.13, self.get_scattered),
            (0.03, self.abort_put_by_close),
            (0.03, self.abort_write_by_close),
            (0.01, self.stall_commit),
            (0.01, self.stall_release),
            (0.05, self.reconnect),
        ]
        weights = [w for w, _ in ops]
        last_report = time.monotonic()
        while time.time() < self.deadline and not self.stop.exists():
            (_, op) = self.rng.choices(ops, weights)[0]
            name = op.__name__
            started = time.monotonic()
            self.counts["ops"] += 1
            try:
                op()
            except (StoreFull, TooManyRequests):
                self.counts["refused"] += 1
            except BlockNotFound:
                self.counts["misses"] += 1
            except LeaseExpired:
                self.counts["expired_unplanned"] += 1
            except InternalError as exc:
                self.counts["internal_errors"] += 1
                self.unexpected(name, exc)
            except TransferError as exc:
                self.counts[f"transfer:{type(exc).__name__}"] += 1
                self.drop()
            except Exception as exc:
                self.unexpected(name, exc)
                self.drop()
            took = time.monotonic() - started
            if took > 3 * CLIENT_TIMEOUT_S:
                self.emit("B", {"what": f"{name} took {took:.1f} s"})
            if time.monotonic() - last_report > 1.0:
                self.emit("S", dict(self.counts))
                last_report = time.monotonic()
        self.drop()
        self.emit("S", dict(self.counts))
        return 0

    # -- ops -----------------------------------------------------------------------------

    def put(self) -> None:
        ns = self.rng.choice(NAMESPACES)
        conversation = self.rng.randrange(CONVERSATIONS)
        length = self.rng.randint(1, BLOCKS)
        keys = prefix(ns, conversation, length)
        sent = self.client(ns).put(keys, blocks_of(keys))
        self.emit("C", [ns, conversation, length])
        self.committed.append((ns, conversation, length))
        self.counts["puts"] += 1
        self.counts["blocks_sent"] += sum(sent)

    def get_prefix(self) -> None:
        """A prefix this worker committed (all of it must be there) or anyone's."""
        mine = bool(self.committed) and self.rng.random() < 0.5
        if mine:
            ns, conversation, length = self.rng.choice(self.committed)
        else:
            ns = self.rng.choice(NAMESPACES)
            conversation = self.rng.randrange(CONVERSATIONS)
            length = self.rng.randint(1, BLOCKS)
        keys = prefix(ns, conversation, length)
        client = self.client(ns)
        held = client.match_prefix(keys)
        if mine and held < length:
            self.emit("L", {"ns": ns, "conversation": conversation, "length": length, "held": held})
        if held == 0:
            self.counts["misses"] += 1
            return
        self.read(client, ns, keys[:held])

    def get_scattered(self) -> None:
        """Blocks of random conversations, one each: mostly misses (all or nothing)."""
        ns = self.rng.choice(NAMESPACES)
        keys = [
            block_key(ns, self.rng.randrange(CONVERSATIONS), self.rng.randrange(4))
            for _ in range(self.rng.randint(1, 4))
        ]
        self.read(self.client(ns), ns, list(dict.fromkeys(keys)))

    def read(self, client: StoreClient, ns: str, keys: list[BlockKey]) -> None:
        out = np.full((len(keys), BB), 0x5A, dtype=np.uint8)
        try:
            client.get(keys, out)
        except LeaseExpired:  # the read outlived its lease: the client says not to trust it
            self.counts["expired_unplanned"] += 1
            self.counts["flagged_wrong_bytes"] += sum(n for _, n in wrong_bytes(keys, out))
            return
        self.counts["gets"] += 1
        self.counts["bytes_verified"] += len(keys) * BB
        for i, wrong in wrong_bytes(keys, out):
            self.counts["wrong_bytes"] += wrong
            self.emit("W", {"ns": ns, "key": keys[i].hex(), "wrong": wrong, "in": "get"})

    def abort_put_by_close(self) -> None:
        """Close the client while a put is on its way (from another thread)."""
        ns = self.rng.choice(NAMESPACES)
        client = self.client(ns)
        conversation = self.rng.randrange(CONVERSATIONS)
        length = self.rng.randint(1, BLOCKS)
        keys = prefix(ns, conversation, length)
        outcome: dict[str, Any] = {}

        def put() -> None:
            try:
                client.put(keys, blocks_of(keys))
                outcome["ok"] = True
            except BaseException as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=put, daemon=True)
        thread.start()
        time.sleep(self.rng.uniform(0.0, 0.03))
        self.clients.pop(ns, None)
        client.close()
        thread.join(3 * CLIENT_TIMEOUT_S)
        self.counts["aborted_puts"] += 1
        if thread.is_alive():
            self.emit("B", {"what": "a put went on after its client was closed (hung)"})
        elif outcome.get("ok"):
            self.emit("C", [ns, conversation, length])
            self.committed.append((ns, conversation, length))
            self.counts["puts"] += 1

    def _stage(self, client: StoreClient, keys: list[BlockKey]) -> tuple[int, list[int], list[int]]:
        """Stage ``keys``: the lease, and the indices of the keys that got a slot, and
        those slots (a key already stored gets none)."""
        reply = client._call({"op": "stage", "ns": client._ns, "keys": keys})
        given = [(i, int(slot)) for i, slot in enumerate(reply["slots"]) if slot is not None]
        return int(reply["lease"]), [i for i, _ in given], [slot for _, slot in given]

    def _ops(self, client: StoreClient, region: int, slots: list[int]) -> np.ndarray:
        ops = np.zeros(len(slots), dtype=OP_DTYPE)
        ops["local_region"] = region
        ops["local_offset"] = np.arange(len(slots), dtype=np.uint64) * np.uint64(BB)
        ops["remote_region"] = client._region
        ops["remote_offset"] = np.asarray(slots, dtype=np.uint64) * np.uint64(BB)
        ops["length"] = BB
        return ops

    def abort_write_by_close(self) -> None:
        """Stage, start writing the blocks, and close the client before the write is done
        (no commit: a dead writer's slots must come back, its bytes never be seen)."""
        ns = self.rng.choice(NAMESPACES)
        client = self.client(ns)
        keys = prefix(ns, self.rng.randrange(CONVERSATIONS), self.rng.randint(1, BLOCKS))
        keys = keys[: client._request_keys]
        lease, picked, slots = self._stage(client, keys)
        self.counts["aborted_puts"] += 1
        if lease and picked:
            data = blocks_of([keys[i] for i in picked])
            region = client.register(data)
            client.peer.write(self._ops(client, region.id, slots))
            time.sleep(self.rng.uniform(0.0, 0.005))
        self.clients.pop(ns, None)
        client.close()

    def stall_commit(self) -> None:
        """Stage and write, stall past the lease, then commit: the server must refuse."""
        ns = self.rng.choice(NAMESPACES)
        client = self.client(ns)
        keys = prefix(ns, self.rng.randrange(CONVERSATIONS), self.rng.randint(1, 4))
        lease, picked, slots = self._stage(client, keys)
        if not lease or not picked:
            return
        data = blocks_of([keys[i] for i in picked])
        region = client.register(data)
        try:
            ops = self._ops(client, region.id, slots)
            client.peer.write(ops).wait(CLIENT_TIMEOUT_S)  # the bytes, without the commit
        finally:
            client.engine.unregister(region)
        time.sleep(LEASE_TTL + 0.5)
        try:
            client._call({"op": "commit", "ns": client._ns, "lease": lease})
        except LeaseExpired:
            self.counts["expired_planned"] += 1
        else:
            self.emit("B", {"what": "a commit after the lease expired was accepted"})

    def stall_release(self) -> None:
        """Pin, stall past the lease, read, then release: both must be refused."""
        if not self.committed:
            return
        ns, conversation, length = self.rng.choice(self.committed)
        client = self.client(ns)
        keys = prefix(ns, conversation, min(length, client._request_keys))
        reply = client._call({"op": "pin", "ns": client._ns, "keys": keys})
        lease, slots = int(reply["lease"]), [int(s) for s in reply["slots"]]
        time.sleep(LEASE_TTL + 0.5)
        out = np.full((len(keys), BB), 0x5A, dtype=np.uint8)
        region = client.register(out, access="none")
        try:
            client.peer.read(self._ops(client, region.id, slots)).wait(CLIENT_TIMEOUT_S)
        except TransferError:
            self.counts["late_reads_refused"] += 1
        else:
            wrong = sum(n for _, n in wrong_bytes(keys, out))
            self.emit("B", {"what": "a read after the lease expired was served", "wrong": wrong})
        finally:
            client.engine.unregister(region)
        try:
            client._call({"op": "release", "ns": client._ns, "lease": lease})
        except LeaseExpired:
            self.counts["expired_planned"] += 1
        else:
            self.emit("B", {"what": "a release after the lease expired was accepted"})

    def reconnect(self) -> None:
        self.drop(self.rng.choice(NAMESPACES))


def _worker_main(argv: list[str]) -> int:
    config = json.loads(argv[0])
    return _Worker(config).run()


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
            address = client.peer._info.transports["tcp"]
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
        reply = client._call({"op": "stage", "ns": client._ns, "keys": keys})
        lease, slots = int(reply["lease"]), [s for s in reply["slots"] if s is not None]
        if not lease or not slots:
            return
        stream = RawStream(client)
        try:
            ops = descriptors(
                client._region, region_key(client, client._region), [(s * BB, BB) for s in slots]
            )
            stream.start_write(ops)
            total = len(slots) * BB
            first = self.rng.randrange(1, total)
            stream.send(b"\xaa" * first)
            time.sleep(0.2)  # admitted: the server waits for the rest
            ending = self.rng.choice(["abort", "expire"])
            if ending == "abort":
                client._call({"op": "abort", "ns": client._ns, "lease": lease})
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
                client._call({"op": "commit", "ns": client._ns, "lease": lease})
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


# -- the driver --------------------------------------------------------------------------


def _proc_status(pid: int, disk: Path) -> dict[str, int]:
    """Threads, and resident memory in kB: all of it (VmRSS), and the part that is pages of
    the disk tier's files mapped in by LMDB reads (page cache the kernel reclaims at will,
    as large as the blocks read from disk: not the server's own memory)."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("Threads", "VmRSS"):
                fields[name] = int(value.split()[0])
    mapped = 0
    on_disk = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if not head[0].endswith(":"):  # a mapping's first line: range perms ... path
                on_disk = len(head) >= 6 and head[5].startswith(str(disk))
            elif head[0] == "Rss:" and on_disk:
                mapped += int(head[1])
    fields["DiskMapped"] = mapped
    fields["Own"] = fields["VmRSS"] - mapped
    return fields


class _Soak:
    def __init__(self, tmp: Path, duration: float, seed: int) -> None:
        self.tmp = tmp
        self.duration = duration
        self.rng = random.Random(seed)
        self.server: subprocess.Popen[str] | None = None
        self.server_err: IO[str] | None = None
        self.address = ""
        self.workers: dict[int, subprocess.Popen[bytes]] = {}
        self.worker_errs: dict[int, IO[bytes]] = {}
        self.next_worker = 0
        self.kills = 0
        self.stop_file = tmp / "stop"
        self.deadline = 0.0
        self.failures: list[str] = []

    def start_server(self) -> None:
        self.server_err = open(self.tmp / "server.stderr", "w")  # noqa: SIM115
        self.server = subprocess.Popen(
            [
                *(sys.executable, "-m", "kvbridge", "serve", "--port", "0"),
                *("--host-capacity", str(HOST_CAPACITY), "--max-namespaces", "2"),
                *("--lease-ttl", str(LEASE_TTL)),
                *("--disk-path", str(self.tmp / "disk"), "--disk-capacity", str(DISK_CAPACITY)),
            ],
            stdout=subprocess.PIPE,
            stderr=self.server_err,
            text=True,
        )
        assert self.server.stdout is not None
        try:
            self.address, _ = read_listening(self.server.stdout)
        except RuntimeError:
            raise AssertionError(self.server_stderr()) from None

    def server_stderr(self) -> str:
        return (self.tmp / "server.stderr").read_text(errors="replace")

    def start_worker(self) -> None:
        wid = self.next_worker
        self.next_worker += 1
        config = {
            "address": self.address,
            "deadline": self.deadline,
            "stop": str(self.stop_file),
            "seed": self.rng.randrange(1 << 63),
            "log": str(self.tmp / f"worker-{wid}.log"),
        }
        self.worker_errs[wid] = open(self.tmp / f"worker-{wid}.stderr", "wb")  # noqa: SIM115
        self.workers[wid] = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "worker", json.dumps(config)],
            stdout=subprocess.DEVNULL,
            stderr=self.worker_errs[wid],
        )

    def kill_worker(self, wid: int) -> None:
        proc = self.workers.pop(wid)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(30)

    def stop_all(self) -> None:
        """Kill whatever is still running (the test's finally)."""
        for wid in list(self.workers):
            with contextlib.suppress(Exception):
                self.kill_worker(wid)
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGKILL)
            with contextlib.suppress(Exception):
                self.server.communicate(timeout=30)
        for f in [self.server_err, *self.worker_errs.values()]:
            if f is not None:
                f.close()

    def open_namespaces(self) -> None:
        for ns in NAMESPACES:
            with StoreClient(self.address, block_bytes=BB, namespace=ns) as client:
                assert client.capacity_blocks == HOST_CAPACITY // 2 // BB

    def open_leases(self) -> int:
        return int(server_stats(self.address)["server"]["open_leases"])

    def status(self) -> dict[str, int]:
        assert self.server is not None
        return _proc_status(self.server.pid, self.tmp / "disk")

    def leases_gone(self, within_s: float) -> tuple[int, float]:
        """Poll until the server holds no lease: (leases left, seconds it took)."""
        started = time.monotonic()
        leases = self.open_leases()
        while leases and time.monotonic() - started < within_s:
            time.sleep(0.2)
            leases = self.open_leases()
        return leases, time.monotonic() - started

    def settle(self, baseline_threads: int) -> dict[str, int]:
        """Wait (bounded) until the server runs no more threads than ``baseline_threads``."""
        give_up = time.monotonic() + SETTLE_S
        status = self.status()
        while status["Threads"] > baseline_threads and time.monotonic() < give_up:
            time.sleep(0.5)
            status = self.status()
        return status

    def read_logs(
        self,
    ) -> tuple[set[tuple[str, int, int]], Counter[str], list[tuple[str, str]]]:
        """Committed keys (ns, conversation, block), summed counters, and reported events
        (kind, text)."""
        committed: set[tuple[str, int, int]] = set()
        counts: Counter[str] = Counter()
        events: list[tuple[str, str]] = []
        for wid in range(self.next_worker):
            path = self.tmp / f"worker-{wid}.log"
            last: dict[str, int] = {}
            if path.exists():
                for line in path.read_text().splitlines():
                    kind, _, body = line.partition(" ")
                    try:
                        payload = json.loads(body)
                    except ValueError:
                        continue
                    if kind == "C":
                        ns, conversation, length = payload
                        committed.update((ns, conversation, i) for i in range(length))
                    elif kind == "S":
                        last = payload
                    elif kind in ("W", "B", "L", "X"):
                        events.append((kind, f"worker {wid}: {kind} {body}"))
                    if kind == "W":
                        counts["wrong_bytes_reported"] += int(payload["wrong"])
            counts.update(last)
        return committed, counts, events

    def verify_committed(self, committed: set[tuple[str, int, int]]) -> tuple[int, int, int]:
        """Read every committed block: (blocks read, blocks missing, wrong bytes)."""
        read = missing = wrong = 0
        for ns in NAMESPACES:
            keys = sorted(block_key(n, c, i) for n, c, i in committed if n == ns)
            with StoreClient(self.address, block_bytes=BB, namespace=ns, timeout=30) as client:
                step = client._request_keys
                for start in range(0, len(keys), step):
                    chunk = keys[start : start + step]
                    present = client.contains(chunk)
                    gone = [k for k, p in zip(chunk, present, strict=True) if not p]
                    if gone:
                        missing += len(gone)
                        self.failures.append(
                            f"{ns}: committed block {gone[0].hex()} gone "
                            f"({len(gone)} in this chunk)"
                        )
                    chunk = [k for k, p in zip(chunk, present, strict=True) if p]
                    if not chunk:
                        continue
                    out = np.full((len(chunk), BB), 0x5A, dtype=np.uint8)
                    client.get(chunk, out)
                    read += len(chunk)
                    for i, n in wrong_bytes(chunk, out):
                        wrong += n
                        self.failures.append(f"{ns}: committed block {chunk[i].hex()}: {n} wrong")
        return read, missing, wrong


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the server's /proc")
def test_soak(tmp_path: Path) -> None:
    duration = soak_seconds()
    seed = int(os.environ.get("KVBRIDGE_SOAK_SEED", random.randrange(1 << 32)))
    soak = _Soak(tmp_path, duration, seed)
    hostile: _Hostile | None = None
    try:
        soak.start_server()
        assert soak.server is not None
        soak.open_namespaces()  # the slabs are prefaulted here: measure after
        time.sleep(1.0)
        base = soak.status()
        peak_threads = base["Threads"]

        soak.deadline = time.time() + duration
        for _ in range(WORKERS):
            soak.start_worker()
        hostile = _Hostile(soak.address, seed)
        hostile.start()
        next_kill = time.monotonic() + soak.rng.uniform(*KILL_EVERY_S)
        crashed: list[str] = []
        while time.time() < soak.deadline:
            time.sleep(0.2)
            if soak.server.poll() is not None:
                soak.failures.append(f"the server exited ({soak.server.returncode}) mid-run")
                break
            peak_threads = max(peak_threads, soak.status()["Threads"])
            for wid, proc in list(soak.workers.items()):
                if proc.poll() is not None and time.time() < soak.deadline - 1:
                    crashed.append(f"worker {wid} exited {proc.returncode} before the end")
                    soak.workers.pop(wid)
                    soak.start_worker()
            if time.monotonic() >= next_kill and time.time() < soak.deadline - 1:
                soak.kill_worker(soak.rng.choice(list(soak.workers)))
                soak.kills += 1
                soak.start_worker()
                next_kill = time.monotonic() + soak.rng.uniform(*KILL_EVERY_S)

        stuck_threads = hostile.close()
        soak.stop_file.touch()
        give_up = time.monotonic() + STOP_GRACE_S
        while soak.workers and time.monotonic() < give_up:
            for wid, proc in list(soak.workers.items()):
                if proc.poll() is not None:
                    soak.workers.pop(wid)
                    if proc.returncode != 0:
                        crashed.append(f"worker {wid} exited {proc.returncode}")
            time.sleep(0.2)
        stragglers = sorted(soak.workers)
        for wid in stragglers:
            soak.kill_worker(wid)
        soak.failures += crashed
        if stragglers:
            soak.failures.append(f"workers {stragglers} still running {STOP_GRACE_S:.0f} s late")
        if stuck_threads:
            soak.failures.append(f"hostile threads {stuck_threads} did not stop")
        soak.failures += hostile.violations

        # Every client is gone: their sessions end with their streams, and their leases too.
        alive = soak.server.poll() is None
        leases, leases_s = soak.leases_gone(LEASES_GONE_S) if alive else (-1, 0.0)
        committed, counts, events = soak.read_logs()
        read = missing = wrong_after = 0
        if alive:
            read, missing, wrong_after = soak.verify_committed(committed)
        after = soak.settle(base["Threads"]) if alive else base
        final_leases = soak.open_leases() if alive else -1
        stats_cli = subprocess.run(
            [sys.executable, "-m", "kvbridge", "stats", soak.address],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        stderr = soak.server_stderr()
        tracebacks = stderr.count("Traceback")
        grown = (after["Own"] - base["Own"]) << 10
        print(
            f"\nsoak: {duration:.0f} s, seed {seed}: {counts['ops']} ops ({counts['puts']} puts, "
            f"{counts['gets']} gets), {counts['bytes_verified'] / 2**20:.0f} MiB verified, "
            f"{len(committed)} committed blocks re-read ({read} ok, {missing} missing), "
            f"{soak.kills} kills, {counts['expired_planned']} planned expiries refused "
            f"(+{counts['expired_unplanned']} unplanned), {counts['aborted_puts']} aborted puts, "
            f"wrong bytes {counts['wrong_bytes']} during + {wrong_after} after; "
            f"hostile: {hostile.counts['hellos']} hellos, "
            f"{hostile.counts['loris_connections']} slow-loris (longest "
            f"{hostile.loris_max_age:.1f} s), {hostile.counts['late_writes']} late writes; "
            f"leases {leases} after {leases_s:.1f} s; "
            f"server threads {base['Threads']}->{peak_threads}->{after['Threads']}, "
            f"RSS {base['VmRSS'] >> 10}->{after['VmRSS'] >> 10} MiB "
            f"(without LMDB file pages {base['Own'] >> 10}->{after['Own'] >> 10} MiB), "
            f"stderr {len(stderr.splitlines())} lines, {tracebacks} tracebacks",
            flush=True,
        )
        details = {k: v for k, v in sorted(counts.items()) if k not in ("ops", "bytes_verified")}
        print(f"soak details: workers {details}; hostile {dict(hostile.counts)}", flush=True)
        for line in [*(text for _, text in events[:20]), *hostile.errors[:10]]:
            print(f"soak event: {line}", flush=True)

        # (a) nobody read a wrong byte, during the run or after it
        assert counts["wrong_bytes"] == 0 and counts["wrong_bytes_reported"] == 0, events
        assert wrong_after == 0, soak.failures
        # (b) every committed block is still there, with its bytes
        assert alive, f"the server died: {stderr[-3000:]}"
        assert missing == 0, soak.failures
        assert not [e for kind, e in events if kind == "L"], events
        # no refused-by-contract operation was accepted, no call hung, no server bug surfaced
        assert not [e for kind, e in events if kind == "B"], events
        assert counts["internal_errors"] == 0, events
        # (c) threads and memory back where they started
        assert after["Threads"] <= base["Threads"], (base, after)
        assert grown <= RSS_SLACK_BYTES, (base, after)
        # (d) alive, answering, no lease left once the clients were gone, a clean log
        assert leases == 0, f"{leases} leases open {LEASES_GONE_S} s after every client left"
        assert final_leases == 0, final_leases
        assert stats_cli.returncode == 0, stats_cli.stderr
        assert "open leases 0" in stats_cli.stdout, stats_cli.stdout
        assert tracebacks == 0, stderr[-5000:]
        assert not soak.failures, soak.failures
    finally:
        if hostile is not None:
            hostile.close()
        soak.stop_all()
        shutil.rmtree(tmp_path / "disk", ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        sys.exit(_worker_main(sys.argv[2:]))
    sys.exit(f"usage: {sys.argv[0]} worker CONFIG (the soak test starts these itself)")
