"""A demo worker process: prefill (push) or decode (pull and verify).

``python -m kvbridge.tools._demo_worker ROLE SERVER TASKS RESULTS BLOCK_TOKENS BLOCK_BYTES
NAMESPACE TRANSPORTS``. Tasks and results are msgpack maps over zmq PULL/PUSH sockets the
coordinator binds. Prefill hashes the prompt into block keys, asks the server how much of
it is cached, "computes" the missing blocks (bytes that are a pure function of the key,
standing in for KV tensors) and pushes them. Decode pulls every block of the prompt and
checks each byte against what prefill must have pushed.

Prefill loads the cached prefix before it pushes, as a serving engine must (the new tokens
attend to it): that read also marks the prefix as used, so the blocks it is about to push
cannot evict the prefix that decode will pull next.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import blake3
import msgpack
import numpy as np
import zmq

from kvbridge.store import BlockKey, BlockNotFound, ClusterClient, StoreClient, prefix_hashes

from ._demo_servers import CLUSTER

_PATTERN_BYTES = 4096


def _pattern(key: BlockKey) -> np.ndarray:
    return np.frombuffer(blake3.blake3(key).digest(_PATTERN_BYTES), dtype=np.uint8)


def fill_block(block: np.ndarray, key: BlockKey) -> None:
    """Write the stand-in KV bytes of ``key`` (its 4 KiB BLAKE3 stream, repeated)."""
    pattern = _pattern(key)
    whole = block.size // _PATTERN_BYTES * _PATTERN_BYTES
    block[:whole].reshape(-1, _PATTERN_BYTES)[:] = pattern
    block[whole:] = pattern[: block.size - whole]


def block_matches(block: np.ndarray, key: BlockKey) -> bool:
    pattern = _pattern(key)
    whole = block.size // _PATTERN_BYTES * _PATTERN_BYTES
    return bool(
        (block[:whole].reshape(-1, _PATTERN_BYTES) == pattern).all()
        and (block[whole:] == pattern[: block.size - whole]).all()
    )


class _Worker:
    def __init__(
        self, client: StoreClient | ClusterClient, block_tokens: int, namespace: str
    ) -> None:
        self.client = client
        self.block_tokens = block_tokens
        self.namespace = namespace
        self.block_bytes = client.block_bytes
        self._buffer = np.empty(0, dtype=np.uint8)

    def blocks(self, count: int) -> np.ndarray:
        """A ``(count, block_bytes)`` view of a buffer reused across requests."""
        need = count * self.block_bytes
        if self._buffer.size < need:
            self._buffer = np.empty(need, dtype=np.uint8)
        return self._buffer[:need].reshape(count, self.block_bytes)

    def keys(self, task: dict[str, Any]) -> list[BlockKey]:
        tokens = np.frombuffer(task["tokens"], dtype=np.int32)
        return prefix_hashes(tokens, self.block_tokens, namespace=self.namespace)

    def prefill(self, task: dict[str, Any]) -> dict[str, Any]:
        keys = self.keys(task)
        blocks = self.blocks(len(keys))
        start = time.perf_counter()
        cached = self.client.match_prefix(keys)
        while cached:  # load the cached prefix; what vanished meanwhile is computed instead
            try:
                self.client.get(keys[:cached], blocks[:cached])
                break
            except BlockNotFound as exc:
                gone = set(exc.keys)
                cached = next(i for i, key in enumerate(keys) if key in gone)
        load_s = time.perf_counter() - start
        bad = sum(not block_matches(b, k) for b, k in zip(blocks[:cached], keys, strict=False))
        for block, key in zip(blocks[cached:], keys[cached:], strict=True):
            fill_block(block, key)  # "compute" the rest
        start = time.perf_counter()
        sent = self._put(keys[cached:], blocks[cached:], cached) if cached < len(keys) else []
        return {
            "load_s": load_s,
            "push_s": time.perf_counter() - start,
            "blocks": len(keys),
            "cached": cached,
            "pushed": sum(sent),
            "bad": bad,
        }

    def _put(self, keys: list[BlockKey], blocks: np.ndarray, first: int) -> list[bool]:
        if isinstance(self.client, ClusterClient):  # keys[0] is block `first` of its chain
            return self.client.put(keys, blocks, chain_start=first)
        return self.client.put(keys, blocks)

    def decode(self, task: dict[str, Any]) -> dict[str, Any]:
        keys = self.keys(task)
        blocks = self.blocks(len(keys))
        start = time.perf_counter()
        missing = 0
        try:
            if keys:
                self.client.get(keys, blocks)
        except BlockNotFound as exc:  # evicted between push and pull: counted, not fatal
            missing = len(exc.keys)
        pull_s = time.perf_counter() - start
        bad = (
            0
            if missing
            else sum(not block_matches(b, k) for b, k in zip(blocks, keys, strict=True))
        )
        return {"pull_s": pull_s, "blocks": len(keys), "missing": missing, "bad": bad}


def _connect(
    server: str, block_bytes: int, namespace: str, transports: list[str]
) -> StoreClient | ClusterClient:
    """A client of the demo's server, or of its cluster when ``server`` is an etcd URL."""
    if server.startswith("etcd://"):
        return ClusterClient(
            server,
            block_bytes=block_bytes,
            namespace=namespace,
            cluster=CLUSTER,
            transports=transports,
        )
    return StoreClient(server, block_bytes=block_bytes, namespace=namespace, transports=transports)


def main(argv: list[str]) -> int:
    role, server, tasks_at, results_at, block_tokens, block_bytes, namespace, transports = argv
    context = zmq.Context()
    tasks = context.socket(zmq.PULL)
    results = context.socket(zmq.PUSH)
    for sock in (tasks, results):
        sock.setsockopt(zmq.LINGER, 2000)
    tasks.connect(tasks_at)
    results.connect(results_at)
    try:
        with _connect(server, int(block_bytes), namespace, transports.split(",")) as client:
            worker = _Worker(client, int(block_tokens), namespace)
            run = worker.prefill if role == "prefill" else worker.decode
            results.send(msgpack.packb({"ready": role}))
            while True:
                task = msgpack.unpackb(tasks.recv())
                if task.get("stop"):
                    break
                reply = run(task)
                reply.update(id=task["id"], role=role, done_at=time.time())
                results.send(msgpack.packb(reply))
    finally:
        tasks.close()
        results.close()
        context.term()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
