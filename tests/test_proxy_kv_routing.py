"""``kvbridge proxy --route kv``: a prefill instance is chosen by where the prompt's prefix
is cached (each instance's own KV events, as vLLM publishes them, and the shared tiers' as
the relay does), then by load; a prompt that is not token ids, or an index that knows
nothing, leaves it to load. Publishers are PUB sockets on loopback that speak vLLM's and the
relay's formats; the instances are the proxy tests' vLLM-like fakes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

pytest.importorskip("aiohttp", reason="kvbridge proxy needs aiohttp (the proxy extra)")
import zmq
from aiohttp import ClientSession
from proxy_support import Deployment, completion, post, until_async

from kvbridge.tools._proxy_kv import KvRouting
from kvbridge.tools._proxy_settings import KV_SLACK as SLACK

BLOCK = 2


class _Publisher:
    """One instance's KV events, as vLLM sends them: it connects to the proxy's endpoint."""

    def __init__(self, endpoint: str, *, bind: bool = False) -> None:
        context: zmq.Context[Any] = zmq.Context.instance()
        self.socket: zmq.Socket[bytes] = context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        (self.socket.bind if bind else self.socket.connect)(endpoint)
        self.seq = 0
        self.sent: list[bytes] = []

    def stored(self, prompt: list[int], *, medium: str = "GPU") -> None:
        blocks = len(prompt) // BLOCK
        hashes = [hash(tuple(prompt[: (n + 1) * BLOCK])) & 0xFFFF_FFFF for n in range(blocks)]
        event = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": None,
            "token_ids": prompt[: blocks * BLOCK],
            "block_size": BLOCK,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
        }
        self.sent.append(msgpack.packb([time.time(), [event], None]))
        self._send(self.sent[-1])

    def repeat(self) -> None:
        """Everything said so far, again (a PUB drops what it sends before its subscriber
        has joined; storing a block again changes nothing)."""
        for batch in self.sent:
            self._send(batch)

    def _send(self, batch: bytes) -> None:
        self.socket.send_multipart([b"", self.seq.to_bytes(8, "big"), batch])
        self.seq += 1

    def close(self) -> None:
        self.socket.close()


class _Routing:
    """The shared tiers' relay endpoint and the publishers of every source (each
    instance's made once the deployment knows its URL)."""

    def __init__(self) -> None:
        self.shared = _Publisher("tcp://127.0.0.1:0", bind=True)
        bound = self.shared.socket.getsockopt(zmq.LAST_ENDPOINT)
        self.shared_endpoint = bound.decode() if isinstance(bound, bytes) else ""
        self.publishers: list[_Publisher] = []

    def make(self, urls: list[str]) -> KvRouting:
        """The routing, binding any free port for each instance; a publisher for each."""
        any_port = dict.fromkeys(urls, "tcp://127.0.0.1:0")
        routing = KvRouting(BLOCK, any_port, (self.shared_endpoint, None))
        self.publishers = [_Publisher(routing.endpoints[url]) for url in urls]
        return routing

    def close(self) -> None:
        for publisher in [*self.publishers, self.shared]:
            publisher.close()


@pytest.fixture
def routing() -> Iterator[_Routing]:
    made = _Routing()
    yield made
    made.close()


async def _prefilled_by(session: ClientSession, d: Deployment, prompt: Any) -> int:
    """Which prefill fake (index) took a completion of ``prompt``."""
    before = [len(fake.bodies) for fake in d.prefills]
    status, data = await post(
        session, f"{d.url}/v1/completions", completion(prompt=prompt, stream=False)
    )
    assert status == 200, data
    after = [len(fake.bodies) for fake in d.prefills]
    (index,) = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if b > a]
    return index


async def _known(
    d: Deployment, routing: _Routing, prompt: list[int], scores: dict[str, int]
) -> None:
    """Until the proxy's index says ``scores`` of ``prompt``: every publisher says again
    what it said until its events arrived (the first may go before its subscriber joined)."""
    kv = d.kv
    assert kv is not None

    async def arrived() -> bool:
        if kv.scores({"prompt": prompt}) == scores:
            return True
        for publisher in [*routing.publishers, routing.shared]:
            publisher.repeat()
        return False

    await until_async(arrived, "the events reached the index")


async def _async(value: bool) -> bool:
    return value


def test_a_prompt_goes_where_its_prefix_is_cached(routing: _Routing) -> None:
    long_prompt, other = list(range(1, 13)), list(range(100, 110))

    async def scenario() -> None:
        async with Deployment(prefills=3, kv=routing.make) as d, ClientSession() as session:
            urls = [fake.url for fake in d.prefills]
            publishers = routing.publishers
            publishers[2].stored(long_prompt)  # instance 2 holds all of it
            publishers[1].stored(long_prompt[:4])  # instance 1 its first two blocks
            await _known(d, routing, long_prompt, {urls[2]: 12, urls[1]: 4, "": 0})
            assert [await _prefilled_by(session, d, long_prompt) for _ in range(3)] == [2, 2, 2]
            assert await _prefilled_by(session, d, [long_prompt]) == 2  # a batch of one
            # No instance holds it: load alone (in turn)
            taken = {await _prefilled_by(session, d, other) for _ in range(3)}
            assert taken == {0, 1, 2}
            # A text prompt is not token ids: by load, counted
            await _prefilled_by(session, d, "a text prompt")
            metrics = await d.metrics()
            assert metrics.value("kvbridge_proxy_kv_unrouted_total") == 1
            assert metrics.value("kvbridge_proxy_kv_routed_tokens_total", choice="hit") == 48
            # The shared tiers hold it: every instance can load it, so load decides
            routing.shared.stored(other)
            await _known(d, routing, other, {"": 10})
            assert {await _prefilled_by(session, d, other) for _ in range(3)} == {0, 1, 2}

    asyncio.run(scenario())


def test_a_busy_instance_past_the_slack_gives_way(routing: _Routing) -> None:
    prompt = list(range(1, 9))

    async def scenario() -> None:
        async with Deployment(prefills=3, kv=routing.make) as d, ClientSession() as session:
            urls = [fake.url for fake in d.prefills]
            routing.publishers[0].stored(prompt)
            await _known(d, routing, prompt, {urls[0]: 8, "": 0})
            d.prefills[0].mode = "stall"  # its prefills wait: outstanding
            stalled = [
                asyncio.create_task(
                    post(
                        session, f"{d.url}/v1/completions", completion(prompt=prompt, stream=False)
                    )
                )
                for _ in range(SLACK + 1)
            ]
            await until_async(
                lambda: _async(d.prefills[0].in_progress == SLACK + 1), "instance 0 is busy"
            )
            assert await _prefilled_by(session, d, prompt) != 0  # past the slack: elsewhere
            d.prefills[0].release()
            await asyncio.gather(*stalled)

    asyncio.run(scenario())


def test_route_kv_flags_are_checked_in_one_line() -> None:
    base = [sys.executable, "-m", "kvbridge", "proxy", "--port", "0", "--route", "kv"]
    base += ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    cases = [
        ([], "--block-size"),
        (["--block-size", "16"], "no --kv-events for http://127.0.0.1:1"),
        (
            ["--block-size", "16", "--kv-events", "http://127.0.0.1:3=tcp://127.0.0.1:0"],
            "a --prefill URL",
        ),
        (["--block-size", "16", "--kv-events", "http://127.0.0.1:1=udp://x"], "tcp://host:port"),
    ]
    for flags, said in cases:
        done = subprocess.run(
            [*base, *flags], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 2 and said in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
