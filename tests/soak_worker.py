"""A soak worker: a separate process that puts, gets and checks blocks, aborts mid-put and
stalls past its leases. ``tests/test_soak.py`` runs it as
``python tests/soak_worker.py worker CONFIG``."""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from attack import raw
from soak_common import (
    BB,
    BLOCKS,
    CLIENT_TIMEOUT_S,
    CONVERSATIONS,
    LEASE_TTL,
    NAMESPACES,
    block_key,
    blocks_of,
    prefix,
    wrong_bytes,
)

from kvbridge.store import (
    BlockKey,
    BlockNotFound,
    InternalError,
    LeaseExpired,
    StoreClient,
    StoreFull,
    TooManyRequests,
)
from kvbridge.transfer import OP_DTYPE, TransferError

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
        reply = raw(client).op("stage", keys=keys)
        given = [(i, int(slot)) for i, slot in enumerate(reply["slots"]) if slot is not None]
        return int(reply["lease"]), [i for i, _ in given], [slot for _, slot in given]

    def _ops(self, client: StoreClient, region: int, slots: list[int]) -> np.ndarray:
        ops = np.zeros(len(slots), dtype=OP_DTYPE)
        ops["local_region"] = region
        ops["local_offset"] = np.arange(len(slots), dtype=np.uint64) * np.uint64(BB)
        ops["remote_region"] = raw(client).region
        ops["remote_offset"] = np.asarray(slots, dtype=np.uint64) * np.uint64(BB)
        ops["length"] = BB
        return ops

    def abort_write_by_close(self) -> None:
        """Stage, start writing the blocks, and close the client before the write is done
        (no commit: a dead writer's slots must come back, its bytes never be seen)."""
        ns = self.rng.choice(NAMESPACES)
        client = self.client(ns)
        keys = prefix(ns, self.rng.randrange(CONVERSATIONS), self.rng.randint(1, BLOCKS))
        keys = keys[: client.request_keys]
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
            raw(client).op("commit", lease=lease)
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
        keys = prefix(ns, conversation, min(length, client.request_keys))
        reply = raw(client).op("pin", keys=keys)
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
            raw(client).op("release", lease=lease)
        except LeaseExpired:
            self.counts["expired_planned"] += 1
        else:
            self.emit("B", {"what": "a release after the lease expired was accepted"})

    def reconnect(self) -> None:
        self.drop(self.rng.choice(NAMESPACES))


def _worker_main(argv: list[str]) -> int:
    config = json.loads(argv[0])
    return _Worker(config).run()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "worker":
        sys.exit(_worker_main(sys.argv[2:]))
    sys.exit(f"usage: {sys.argv[0]} worker CONFIG (the soak test starts these itself)")
