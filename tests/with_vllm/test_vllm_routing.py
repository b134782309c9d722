"""KV-aware routing against the routers' own code: vLLM's saves carry their token ids
into ``kvbridge serve``, ``kvbridge events --publish`` republishes the namespace, and
Dynamo's own KV indexer (``ai-dynamo-runtime`` 1.6.1, ``python -m dynamo.indexer``, in
``.venv-dynamo``: ``tests/with_vllm/run`` makes it) answers each prompt with the tokens
kvbridge holds; a removal lowers its answer, and so does one made while no relay ran
(the relay killed and started again: the indexer sees a gap and replays). The relay's
frames decode with vLLM's own ``KVEventBatch`` types too.

The indexer binds every interface (it has no host flag), so it runs in a network
namespace of its own, joined to the tests' by a veth pair (``peer_namespace.py``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import pytest
import zmq
from harness import BLOCK, HERE, PROMPTS, namespace_of, run_engine, spec, tokens
from helpers import keys, payloads, until
from peer_namespace import PeerNamespace, unavailable
from serve import ServeProcess
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from kvbridge.routing import Layout, PrefixIndex, Relay, Shape, router_hash
from kvbridge.store import BlockKey, CacheServer, Lineage, ServerConfig, StoreClient

DYNAMO = HERE.parents[1] / ".venv-dynamo" / "bin" / "python"
INDEXER_PORT = 8090
MODEL = "kvbridge-test"


class Indexer:
    """Dynamo's indexer over HTTP: ``/register`` and ``/query``."""

    def __init__(self, url: str, log: Path) -> None:
        self.url, self.log = url, log

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            reply: dict[str, Any] = json.loads(answer.read() or b"{}")
            return reply

    def matched(self, prompt: list[int], instance: int = 1) -> int:
        """Tokens of ``prompt`` the indexer says ``instance`` holds."""
        answer = self.post("/query", {"token_ids": prompt, "model_name": MODEL})
        return int(answer["instances"].get(str(instance), {}).get("longest_matched", 0))


@pytest.fixture
def indexer(tmp_path: Path) -> Iterator[tuple[Indexer, PeerNamespace]]:
    if not DYNAMO.exists():
        pytest.skip("Dynamo's indexer is not installed (.venv-dynamo: tests/with_vllm/run)")
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"Dynamo's indexer binds every interface and runs in a namespace: {reason}")
    log = tmp_path / "indexer.log"
    with PeerNamespace() as peer, log.open("w") as out:
        argv = [str(DYNAMO), "-m", "dynamo.indexer", "--port", str(INDEXER_PORT)]
        proc = subprocess.Popen(
            peer.command([*argv, "--threads", "1"]),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            served = Indexer(f"http://{peer.peer_address}:{INDEXER_PORT}", log)
            until(lambda: _healthy(served.url), "the indexer answers", timeout=60)
            yield served, peer
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2):
            return True
    except OSError:
        return False


def _relay(
    server: ServeProcess, ns: str, block_bytes: int, at: tuple[str, str]
) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """``kvbridge events --publish`` as an operator runs it; its bound endpoints."""
    argv = [
        *(sys.executable, "-m", "kvbridge", "events", server.address),
        *("--namespace", ns, "--block-bytes", str(block_bytes), "--block-tokens", str(BLOCK)),
        *("--publish", at[0], "--replay", at[1]),
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    started: dict[str, str] = json.loads(proc.stdout.readline())
    return proc, started


def _keys_of(client: StoreClient, blocks: list[list[int]]) -> list[BlockKey]:
    """The stored blocks whose token ids are each of ``blocks``."""
    snapshot = client.snapshot(lineage=True)
    assert snapshot.lineage is not None
    by_tokens = {
        tuple(lineage.token_ids): key
        for key, lineage in zip(snapshot.keys, snapshot.lineage, strict=True)
        if lineage is not None
    }
    return [by_tokens[tuple(block)] for block in blocks]


def test_dynamos_indexer_answers_what_kvbridge_holds(
    model: str, baseline: list[list[int]], indexer: tuple[Indexer, PeerNamespace]
) -> None:
    dynamo, peer = indexer
    server = ServeProcess("--host-capacity", "64MiB", "--events-port", "0")
    relay: subprocess.Popen[str] | None = None
    try:
        first = run_engine(spec(model, {"server": server.address}))
        assert tokens(first) == baseline
        ns, block_bytes = namespace_of(first["log"])
        here = f"tcp://{peer.address}:0"
        relay, bound = _relay(server, ns, block_bytes, (here, here))
        registration = {
            "instance_id": 1,
            "endpoint": bound["publish"],
            "replay_endpoint": bound["replay"],
            "model_name": MODEL,
            "block_size": BLOCK,
        }
        assert dynamo.post("/register", registration) == {"status": "ok"}
        whole = [len(p) // BLOCK * BLOCK for p in PROMPTS]  # every full block was saved
        until(lambda: [dynamo.matched(p) for p in PROMPTS] == whole, "the indexer holds them")
        base = PROMPTS[0]  # PROMPTS[4] shares its blocks; the others its first one or two
        with StoreClient(server.address, block_bytes=block_bytes, namespace=ns) as client:
            second, third = _keys_of(client, [base[BLOCK : 2 * BLOCK], base[2 * BLOCK : 3 * BLOCK]])
            client.remove([third])
            until(lambda: dynamo.matched(base) == 2 * BLOCK, "a removal lowers the answer")
            assert dynamo.matched(PROMPTS[4]) == 2 * BLOCK
            relay.send_signal(signal.SIGKILL)
            relay.wait()
            client.remove([second])  # while nobody relays it
        relay, again = _relay(server, ns, block_bytes, (bound["publish"], bound["replay"]))
        assert again == bound
        expected = [
            BLOCK if p[:BLOCK] == base[:BLOCK] else w for p, w in zip(PROMPTS, whole, strict=True)
        ]
        until(
            lambda: [dynamo.matched(p) for p in PROMPTS] == expected,
            "the restarted relay's gap replayed: the answers are right again",
        )
        assert "Requesting replay" in dynamo.log.read_text()
    finally:
        if relay is not None:
            relay.send_signal(signal.SIGTERM)
            relay.wait(timeout=30)
        server.kill()


def test_the_relays_frames_decode_with_vllms_own_types() -> None:
    """vLLM 0.32's ``KVEventBatch`` decoder reads the relay's map layout; its array layout
    is llm-d's positional one."""
    config = ServerConfig(port=0, events_port=0, host_capacity=4 * 64 * 4096)
    size = 4
    with CacheServer(config) as server:
        ks = keys(0, 2)
        with StoreClient(server.address, block_bytes=4096, namespace="v", block_tokens=size) as c:
            c.put(
                ks,
                payloads(ks, 4096),
                lineage=[Lineage.of(None, [1, 2, 3, 4]), Lineage.of(ks[0], [5, 6, 7, 8])],
            )
        layouts: tuple[Layout, ...] = ("map", "array")
        for layout in layouts:
            payload = _first_message(server.address, size, Shape(layout))
            if layout == "map":
                batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
                stored = [e for e in batch.events if isinstance(e, BlockStored)]
                assert [e.block_hashes for e in stored] == [[router_hash(k) for k in ks]]
                assert stored[0].token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
                assert (stored[0].block_size, stored[0].medium) == (size, "CPU")
            else:
                events = msgpack.unpackb(payload, raw=False)[1]
                hashes = [router_hash(k) for k in ks]
                want = ["BlockStored", hashes, None, [1, 2, 3, 4, 5, 6, 7, 8], size, None, "CPU"]
                assert [e[:7] for e in events if e[0] == "BlockStored"] == [want]


def _first_message(address: str, size: int, shape: Shape) -> bytes:
    """The first message with a ``BlockStored`` a relay of namespace ``v`` publishes."""
    context: zmq.Context[Any] = zmq.Context.instance()

    def connect() -> StoreClient:
        return StoreClient(address, block_bytes=4096, namespace="v", block_tokens=size)

    with Relay(connect, publish="tcp://127.0.0.1:0", topic=b"t", shape=shape) as relay:
        sub: zmq.Socket[bytes] = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(relay.endpoint)
        try:
            while True:  # the relay sends its last message again every second
                assert sub.poll(10_000), "the relay published nothing"
                payload = sub.recv_multipart()[2]
                if b"BlockStored" in payload:
                    return payload
        finally:
            sub.close(linger=0)


def test_vllms_own_kv_events_index_what_its_prefix_cache_holds(model: str) -> None:
    """vLLM's CPU build publishes its prefix cache's events (``--kv-events-config``): read
    by ``PrefixIndex``, they say the engine holds every full block of each prompt it ran."""
    context: zmq.Context[Any] = zmq.Context.instance()
    sub: zmq.Socket[bytes] = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    # vLLM's publisher binds an endpoint with a wildcard host (every interface) and connects
    # to one with a host: the test binds loopback, and the engine connects to it.
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    heard: list[bytes] = []
    done = threading.Event()

    def listen() -> None:
        while not done.is_set():
            if sub.poll(100):
                heard.append(sub.recv_multipart()[-1])

    listener = threading.Thread(target=listen)
    listener.start()
    try:
        run_engine(spec(model, None, prefix_caching=True, kv_events=events))
    finally:
        done.set()
        listener.join()
        sub.close(linger=0)
    index = PrefixIndex(BLOCK)
    for payload in heard:
        index.apply("engine", msgpack.unpackb(payload, raw=False)[1])
    assert index.stats.malformed == 0 and index.stats.dropped_orphans == 0
    for prompt in PROMPTS:
        whole = len(prompt) // BLOCK * BLOCK
        assert index.matched(prompt) == ({"engine": whole} if whole else {})
