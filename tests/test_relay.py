"""``kvbridge events --publish``: a namespace's stream republished for KV-aware routers.

A router model (``router_model.py``: Dynamo's and llm-d's rules: numbers, replays, chains
by parent, llm-d's positional events) follows the relay while the namespace changes; in
the end it must match each prompt exactly as far as the server holds it. Against Dynamo's
own indexer: ``tests/with_vllm/test_vllm_routing.py``."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import free_port, keys, payloads, until
from router_model import RouterModel

from kvbridge.routing import Layout, Relay, Shape, router_hash
from kvbridge.store import BlockKey, CacheServer, Lineage, ServerConfig, StoreClient

BB = 4096
SIZE = 4
"""Tokens per block."""
NS = "relay"


def _prompt(seed: int, blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * SIZE)]


def _save(client: StoreClient, prompt: list[int], first_key: int, *, tokens: bool = True) -> None:
    """Save a prompt's blocks as a connector does: its chain of keys, each with its tokens."""
    ks = keys(first_key, first_key + len(prompt) // SIZE)
    parents: list[BlockKey | None] = [None, *ks[:-1]]
    lineage = [Lineage.of(up, prompt[n * SIZE : (n + 1) * SIZE]) for n, up in enumerate(parents)]
    client.put(ks, payloads(ks, BB), lineage=lineage if tokens else None)


@pytest.fixture
def server() -> Iterator[CacheServer]:
    """Namespaces of 40 blocks (37 beside their token ids)."""
    config = ServerConfig(port=0, events_port=0, host_capacity=4 * 40 * BB, handoff_ttl=0)
    with CacheServer(config) as served:
        yield served


def _client(address: str) -> StoreClient:
    return StoreClient(address, block_bytes=BB, namespace=NS, timeout=10, block_tokens=SIZE)


def _relay(address: str, *, shape: Shape | None = None, ports: tuple[int, int] = (0, 0)) -> Relay:
    return Relay(
        lambda: _client(address),
        publish=f"tcp://127.0.0.1:{ports[0]}",
        replay=f"tcp://127.0.0.1:{ports[1]}",
        topic=f"kv@kvbridge@{NS}".encode(),
        shape=shape,
    )


def _router(relay: Relay) -> RouterModel:
    return RouterModel(relay.endpoint, relay.replay_endpoint, SIZE)


def _follows(router: RouterModel, expected: list[tuple[list[int], int]]) -> None:
    """Until ``router`` matches each prompt over the tokens expected of it."""

    def right() -> bool:
        router.poll(0.1)
        return all(router.matched(prompt) == tokens for prompt, tokens in expected)

    until(right, "the router matches what the server holds", timeout=20)


@pytest.mark.parametrize("layout", ["array", "map"])
def test_a_router_that_joins_late_matches_every_saved_prompt(
    server: CacheServer, layout: Layout
) -> None:
    a, b = _prompt(1, 5), _prompt(2, 3)
    branch = a[: 3 * SIZE] + _prompt(3, 2)  # shares a's first three blocks
    with _client(server.address) as client:
        _save(client, a, 0)
        _save(client, b, 100)
        _save(client, branch[: 3 * SIZE], 0)  # the shared head: stored already
        ks = keys(200, 202)
        parents: list[BlockKey | None] = [keys(2, 3)[0], ks[0]]
        tail = branch[3 * SIZE :]
        client.put(
            ks,
            payloads(ks, BB),
            lineage=[
                Lineage.of(up, tail[n * SIZE : (n + 1) * SIZE]) for n, up in enumerate(parents)
            ],
        )
        _save(client, _prompt(4, 2), 300, tokens=False)  # no token ids: a router can't use it
        with _relay(server.address, shape=Shape(layout)) as relay:
            until(lambda: relay.blocks == 10, "the relay told of every block with tokens")
            until(lambda: relay.stats.untokened == 2, "prompt 4, saved without token ids, left out")
            router = _router(relay)  # after the relay's first messages: it needs a replay
            expected = [(a, len(a)), (b, len(b)), (branch, len(branch)), (_prompt(4, 2), 0)]
            _follows(router, expected)
            assert router.replays >= 1 and router.topics == {b"kv@kvbridge@relay"}
            assert set(router.blocks) == {
                router_hash(k) for k in [*keys(0, 5), *keys(100, 103), *keys(200, 202)]
            }
            router.close()


def test_removals_and_evictions_lower_what_the_router_matches(server: CacheServer) -> None:
    with _client(server.address) as client, _relay(server.address) as relay:
        router = _router(relay)
        prompts = [_prompt(seed, 6) for seed in range(1, 9)]  # 48 blocks
        for n, prompt in enumerate(prompts[:4]):
            _save(client, prompt, 100 * n)
        _follows(router, [(p, len(p)) for p in prompts[:4]])
        client.remove(keys(3, 4))  # prompt 1's fourth block: it matches three
        _follows(router, [(prompts[0], 3 * SIZE)])
        for n, prompt in enumerate(prompts[4:], start=4):  # past the namespace's blocks
            _save(client, prompt, 100 * n)
        truth = client.snapshot(lineage=True)
        held = set(truth.keys)

        def matched_by_server(n: int) -> int:
            count = 0
            while count < 6 and keys(100 * n + count, 100 * n + count + 1)[0] in held:
                count += 1
            return count * SIZE

        assert len(held) < 48  # something was evicted
        _follows(router, [(p, matched_by_server(n)) for n, p in enumerate(prompts)])
        router.close()


def test_a_tier_move_is_a_removal_from_one_medium_and_a_store_in_another(
    tmp_path: Path,
) -> None:
    config = ServerConfig(
        port=0,
        events_port=0,
        host_capacity=4 * 128 * BB,  # 60 blocks beside the token ids of 1,024
        disk_path=str(tmp_path),
        disk_capacity=4 * (4 << 20),
        handoff_ttl=0,
    )
    with (
        CacheServer(config) as server,
        _client(server.address) as client,
        _relay(server.address) as relay,
    ):
        router = _router(relay)
        prompts = [_prompt(seed, 4) for seed in range(1, 21)]  # 80 blocks
        for n, prompt in enumerate(prompts):
            _save(client, prompt, 100 * n)
        _follows(router, [(p, len(p)) for p in prompts])
        media = {block.medium for block in router.blocks.values()}
        assert media == {"CPU", "DISK"} and len(router.blocks) == 80
        router.close()


def test_a_restarted_relay_and_a_restarted_server_leave_the_router_right() -> None:
    ports = (free_port(), free_port())
    port = free_port()
    config = ServerConfig(port=port, events_port=0, host_capacity=64 * BB, handoff_ttl=0)
    a, b = _prompt(1, 4), _prompt(2, 4)
    with CacheServer(config) as server, _client(server.address) as client:
        _save(client, a, 0)
        _save(client, b, 100)
        with _relay(server.address, ports=ports) as relay:
            router = RouterModel(relay.endpoint, relay.replay_endpoint, SIZE)
            _follows(router, [(a, len(a)), (b, len(b))])
        client.remove(keys(102, 103))  # while no relay runs: nobody tells the router
        with _relay(server.address, ports=ports) as relay:  # a predecessor's word is void
            _follows(router, [(a, len(a)), (b, 2 * SIZE)])
            assert router.cleared >= 1
            server.close()  # the server restarts without its memory: the namespace is empty
            with CacheServer(config), _client(server.address):
                _follows(router, [(a, 0), (b, 0)])
    router.close()


def test_a_router_that_missed_messages_is_replayed_what_it_missed(server: CacheServer) -> None:
    with _client(server.address) as client, _relay(server.address) as relay:
        router = _router(relay)
        prompts = [_prompt(seed, 2) for seed in range(1, 13)]
        _save(client, prompts[0], 0)
        _follows(router, [(prompts[0], 2 * SIZE)])
        before = router.replays
        router.drop_next(3)  # as a slow subscriber's full queue would
        for n, prompt in enumerate(prompts[1:], start=1):
            _save(client, prompt, 100 * n)
        _follows(router, [(p, len(p)) for p in prompts])
        assert router.replays > before
        router.close()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbridge", "events", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_relay_command_refuses_in_one_line(server: CacheServer) -> None:
    base = [server.address, "--namespace", "plain", "--block-bytes", str(BB)]
    publish = ["--publish", "tcp://127.0.0.1:0"]
    no_tokens = _cli(*base, *publish)
    assert no_tokens.returncode == 1 and "--block-tokens" in no_tokens.stderr
    with StoreClient(server.address, block_bytes=BB, namespace="plain"):  # made without tokens
        kept = _cli(*base, *publish, "--block-tokens", "16")
    assert kept.returncode == 1 and "keeps no token ids" in kept.stderr
    bad = _cli(*base, "--publish", "nowhere", "--block-tokens", "16", "--namespace", "x")
    assert bad.returncode == 1 and len(bad.stderr.strip().splitlines()) == 1
    medium = _cli(*base, *publish, "--block-tokens", "16", "--medium", "CPU")
    assert medium.returncode == 1 and "KVBRIDGE=ROUTER" in medium.stderr
