"""``kvbridge events --publish`` (``kvbridge.routing.Relay``) against the stream it relays,
through a real ``kvbridge serve --events-port``, in the same run:

- throughput: puts of 8 prompts of 256 blocks (4 KiB, 16 token ids each, with their
  lineage) until a router's SUB socket has heard every key through the relay, against the
  same puts until a subscriber of the server's own stream (``EventSubscriber``) has: the
  ratio is what the relay adds; with the keys per second the relay republished;
- lag: one block put, then the time until the router hears it through the relay, p50/p99,
  against the time until the direct subscriber hears it.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq
from conftest import _EXTRA_LINES

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from helpers import keys, payloads
from serve import ServeProcess

from kvbridge.routing import Relay
from kvbridge.store import BlockKey, EventSubscriber, Lineage, StoreClient

BB = 4096
TOKENS = 16
PROMPT = 256
PROMPTS = 8
LAGS = 300


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    served = ServeProcess("--host-capacity", "2GiB", "--handoff-ttl", "0", "--events-port", "0")
    yield served
    served.kill()


def _client(server: ServeProcess, namespace: str) -> StoreClient:
    return StoreClient(server.address, block_bytes=BB, namespace=namespace, block_tokens=TOKENS)


def _lineage(ks: list[BlockKey], first: int) -> list[Lineage | None]:
    parents: list[BlockKey | None] = [None, *ks[:-1]]
    return [
        Lineage.of(up, range(first + n * TOKENS, first + (n + 1) * TOKENS))
        for n, up in enumerate(parents)
    ]


class _Heard:
    """Keys stored, counted from a router's SUB socket (the relay's frames) or from a
    subscriber of the server's stream."""

    def __init__(self, sub: zmq.Socket[bytes] | None, direct: EventSubscriber | None) -> None:
        self.sub, self.direct = sub, direct

    def stored(self, seconds: float) -> int:
        if self.direct is not None:
            message = self.direct.receive(seconds)
            return 0 if message is None else sum(stored for _, stored in message.changes)
        assert self.sub is not None
        if not self.sub.poll(int(seconds * 1000)):
            return 0
        payload = self.sub.recv_multipart()[2]
        events = msgpack.unpackb(payload, raw=False)[1]
        return sum(len(e[1]) for e in events if e[0] == "BlockStored")


def _router(relay: Relay) -> zmq.Socket[bytes]:
    context: zmq.Context[Any] = zmq.Context.instance()
    sub: zmq.Socket[bytes] = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(relay.endpoint)
    return sub


def _settle(heard: _Heard) -> None:
    """Drop what waits (a relay's first messages, heartbeats that repeat its last)."""
    while heard.stored(0.3):
        pass


def test_relay_throughput(compare: Callable[..., Any], server: ServeProcess) -> None:
    block = payloads(keys(0, PROMPT), BB)
    rounds = iter(range(1, 1_000_000))
    rates: list[float] = []
    with (
        _client(server, "relayed") as relayed_client,
        _client(server, "direct") as direct_client,
        Relay(lambda: _client(server, "relayed"), publish="tcp://127.0.0.1:0", topic=b"t") as relay,
        EventSubscriber(direct_client.subscription()) as direct,
    ):
        through = _Heard(_router(relay), None)
        straight = _Heard(None, direct)
        time.sleep(1.0)  # the relay subscribed; the router's SUB joined
        _settle(through)

        def puts_until_heard(client: StoreClient, heard: _Heard) -> float:
            base = next(rounds) * PROMPTS * PROMPT
            started = time.perf_counter()
            for p in range(PROMPTS):
                ks = keys(base + p * PROMPT, base + (p + 1) * PROMPT)
                client.put(ks, block, lineage=_lineage(ks, (base + p * PROMPT) * TOKENS))
            count = 0
            while count < PROMPTS * PROMPT:
                count += heard.stored(5.0)
            return time.perf_counter() - started

        def relayed() -> None:
            rates.append(PROMPTS * PROMPT / puts_until_heard(relayed_client, through))

        compare(
            f"{PROMPTS} puts of {PROMPT} blocks with token ids, heard through the relay",
            relayed,
            lambda: puts_until_heard(direct_client, straight),
            baseline_name="the same puts, heard on the server's stream",
            rounds=10,
        )
        assert through.sub is not None
        through.sub.close()
    line = (
        f"relay: {statistics.median(rates):,.0f} keys/s republished (median, the puts "
        f"included); {relay.stats.messages_out} messages, {relay.stats.keys_out} keys"
    )
    _EXTRA_LINES.append(line)
    print(line)


def test_relay_lag(server: ServeProcess) -> None:
    block = payloads(keys(0, 1), BB)
    lags: dict[str, list[float]] = {"relay": [], "direct": []}
    with (
        _client(server, "lag-relayed") as relayed_client,
        _client(server, "lag-direct") as direct_client,
        Relay(
            lambda: _client(server, "lag-relayed"), publish="tcp://127.0.0.1:0", topic=b"t"
        ) as relay,
        EventSubscriber(direct_client.subscription()) as direct,
    ):
        through = _Heard(_router(relay), None)
        straight = _Heard(None, direct)
        time.sleep(1.0)
        _settle(through)
        _settle(straight)
        for i in range(LAGS):
            for name, client, heard in (
                ("relay", relayed_client, through),
                ("direct", direct_client, straight),
            ):
                ks = keys(50_000_000 + i, 50_000_001 + i)
                client.put(ks, block, lineage=_lineage(ks, i))
                started = time.perf_counter()
                while not heard.stored(1.0):
                    pass
                lags[name].append(time.perf_counter() - started)
        assert through.sub is not None
        through.sub.close()
    relay_us, direct_us = (np.array(lags[n]) * 1e6 for n in ("relay", "direct"))
    line = (
        f"commit -> router through the relay p50 {np.percentile(relay_us, 50):.0f} us p99 "
        f"{np.percentile(relay_us, 99):.0f} us; on the server's stream p50 "
        f"{np.percentile(direct_us, 50):.0f} us p99 {np.percentile(direct_us, 99):.0f} us"
    )
    _EXTRA_LINES.append(line)
    print(line)
