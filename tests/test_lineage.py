"""Token ids travel with saves: a put's lineage (each block's parent key and token ids) is
kept by the server beside the new blocks, reported in ``BlockStored`` as chains and in
snapshots; bad lineage is refused whole and changes nothing; its memory comes out of the
namespace's share; clients that send none are served as before."""

from __future__ import annotations

from collections.abc import Iterator

import msgpack
import pytest
from attack import raw
from helpers import keys, payloads, until
from serve import ServeProcess

from kvbridge.store import (
    MAX_BLOCK_TOKENS,
    BadLineage,
    BadRequest,
    BlockKey,
    CacheServer,
    EventSubscriber,
    Lineage,
    Message,
    Noted,
    ServerConfig,
    StoreClient,
    encode_events,
    pack_events,
)

BB = 4096
TOKENS = 4
"""Tokens per block of these tests' namespaces."""


def _chain(ks: list[BlockKey], first_token: int, parent: bytes | None = None) -> list[Lineage]:
    """Each key's lineage in a chain: its parent the key before, 4 token ids each."""
    parents = [parent, *ks[:-1]]
    return [
        Lineage.of(p, range(first_token + TOKENS * i, first_token + TOKENS * (i + 1)))
        for i, p in enumerate(parents)
    ]


@pytest.fixture
def server() -> Iterator[CacheServer]:
    config = ServerConfig(port=0, events_port=0, host_capacity=64 * BB, handoff_ttl=0)
    with CacheServer(config) as served:
        yield served


def _client(server: CacheServer, block_tokens: int = TOKENS, name: str = "lin") -> StoreClient:
    return StoreClient(
        server.address, block_bytes=BB, namespace=name, timeout=10, block_tokens=block_tokens
    )


def _stored_events(subscriber: EventSubscriber, count: int) -> list[dict[str, object]]:
    """The ``BlockStored`` events heard until ``count`` keys were stored."""
    heard: list[Message] = []

    def enough() -> bool:
        message = subscriber.receive(0.1)
        if message is not None:
            heard.append(message)
        return sum(stored for m in heard for _, stored in m.changes) >= count

    until(enough, f"{count} keys stored")
    return [e for m in heard for e in m.events if e["type"] == "BlockStored"]


def test_a_chain_saved_with_its_tokens_is_one_event_and_in_the_snapshot(
    server: CacheServer,
) -> None:
    with _client(server) as client:
        subscriber = EventSubscriber(client.subscription())
        until(lambda: subscriber.receive(0.1) is not None, "subscribed")
        ks = keys(0, 3)
        client.put(ks, payloads(ks, BB), lineage=_chain(ks, 100))
        [event] = _stored_events(subscriber, 3)
        assert event["block_hashes"] == [bytes(k) for k in ks]
        assert event["parent_block_hash"] is None
        assert event["token_ids"] == list(range(100, 112))
        assert event["block_size"] == TOKENS
        # The chain continued by a later put: its first block's parent is the stored tail.
        more = keys(3, 5)
        client.put(more, payloads(more, BB), lineage=_chain(more, 112, parent=ks[-1]))
        [tail] = _stored_events(subscriber, 2)
        assert tail["parent_block_hash"] == bytes(ks[-1])
        assert tail["token_ids"] == list(range(112, 120))
        snapshot = client.snapshot(lineage=True)
        assert snapshot.lineage is not None
        kept = dict(zip(snapshot.keys, snapshot.lineage, strict=True))
        assert kept[ks[1]] == Lineage.of(ks[0], range(104, 108))
        assert kept[more[0]] == Lineage.of(ks[2], range(112, 116))
        assert set(snapshot.media or []) == {"CPU"}
        with _client(server) as other:  # a session takes one snapshot every 0.5 s
            assert other.snapshot().lineage is None  # only asked for
        subscriber.close()


def test_blocks_without_lineage_and_clients_without_tokens_are_served(
    server: CacheServer,
) -> None:
    with _client(server) as saver, _client(server, block_tokens=0) as plain:
        subscriber = EventSubscriber(saver.subscription())
        until(lambda: subscriber.receive(0.1) is not None, "subscribed")
        ks = keys(0, 4)
        lineage: list[Lineage | None] = list(_chain(ks, 0))
        lineage[2] = None  # a block whose tokens the caller does not know
        saver.put(ks, payloads(ks, BB), lineage=lineage)
        other = keys(10, 12)
        plain.put(other, payloads(other, BB))  # opened without tokens: the namespace's kept
        events = _stored_events(subscriber, 6)
        shapes = [(len(e["block_hashes"]), e["block_size"]) for e in events]  # type: ignore[arg-type]
        assert shapes == [(2, TOKENS), (1, 0), (1, TOKENS), (2, 0)]
        assert events[2]["parent_block_hash"] == bytes(ks[2])
        out = payloads(other, BB) * 0
        saver.get(other, out)
        assert (out == payloads(other, BB)).all()
        subscriber.close()


def test_bad_lineage_is_refused_whole_and_changes_nothing(server: CacheServer) -> None:
    with _client(server) as client:
        ks = keys(0, 2)
        with pytest.raises(BadLineage, match="4 token ids"):
            client.put(ks, payloads(ks, BB), lineage=[Lineage.of(None, [1, 2, 3])] * 2)
        with pytest.raises(BadLineage, match="entries"):
            client.put(ks, payloads(ks, BB), lineage=_chain(ks, 0)[:1])
        with pytest.raises(BadLineage, match="int32"):
            Lineage.of(None, [1, 2, 3, 1 << 31])
        # What a hostile client sends straight to the control plane: refused, nothing staged.
        for lineage in (
            [[None, b"\x00" * 8], [None, b"\x00" * 16]],  # too few token ids
            [[b"short", b"\x00" * 16], None],  # a parent that is no key
            [[None, b"\xff" * 16], None],  # negative token ids
            [None],  # not one per key
            "not a list",
        ):
            with pytest.raises(BadRequest):
                raw(client).op("stage", keys=list(ks), lineage=lineage)
        assert client.contains(ks) == [False, False]
        assert client.stats().puts == 0


def test_an_open_stating_other_tokens_is_served_without_lineage(
    server: CacheServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The namespace's creator chose: a later opener stating another number is served,
    its puts send no lineage (it says so once), and the blocks are stored all the same."""
    with _client(server) as first, _client(server, block_tokens=8) as other:
        assert (first.block_tokens, other.block_tokens) == (TOKENS, 0)
        assert "keeps 4 token ids a block, not 8" in caplog.text
        ks = keys(0, 2)
        other.put(ks, payloads(ks, BB), lineage=[Lineage.of(None, range(8))] * 2)
        assert first.contains(ks) == [True, True]
        assert first.snapshot(lineage=True).lineage == [None, None]
    with pytest.raises(BadLineage, match="from 0 to"):
        _client(server, block_tokens=-1)


def test_the_tokens_memory_comes_out_of_the_namespace_share(server: CacheServer) -> None:
    with (
        _client(server, block_tokens=0, name="plain") as plain,
        _client(server, block_tokens=64, name="tokens") as tokens,
    ):
        assert tokens.capacity_blocks < plain.capacity_blocks


def test_a_foreign_namespace_lineage_is_not_in_another_snapshot(server: CacheServer) -> None:
    with _client(server, name="a") as a, _client(server, name="b") as b:
        ks = keys(0, 2)
        a.put(ks, payloads(ks, BB), lineage=_chain(ks, 7))
        b.put(ks, payloads(ks, BB))  # the same keys, saved without tokens in b
        snapshot = b.snapshot(lineage=True)
        assert snapshot.lineage == [None, None]


@pytest.mark.slow
def test_kvbridge_serve_keeps_lineage_bounded_by_its_blocks() -> None:
    """A real server: more chains than the namespace holds; what it keeps never outgrows
    its blocks, and the snapshot's lineage is the stored keys' own."""
    served = ServeProcess("--events-port", "0", "--host-capacity", str(4 * 32 * BB))
    try:
        with StoreClient(
            served.address, block_bytes=BB, namespace="n", timeout=10, block_tokens=TOKENS
        ) as client:
            for start in range(0, 200, 10):
                ks = keys(start, start + 10)
                client.put(ks, payloads(ks, BB), lineage=_chain(ks, start * TOKENS))
            snapshot = client.snapshot(lineage=True)
            assert snapshot.lineage is not None
            assert 0 < len(snapshot.keys) <= client.capacity_blocks
            for key, lineage in zip(snapshot.keys, snapshot.lineage, strict=True):
                assert lineage is not None
                index = keys(0, 200).index(key)
                assert lineage.token_ids == list(range(index * TOKENS, (index + 1) * TOKENS))
    finally:
        served.kill()


def test_a_batch_of_lineage_events_decodes_as_msgpack_vllm_shape() -> None:
    """The event as vLLM's ``BlockStored`` fields name it (msgspec's map encoding)."""
    ks = keys(0, 2)
    noted: list[Noted] = [(k, "host", lin) for k, lin in zip(ks, _chain(ks, 5), strict=True)]
    batch = msgpack.unpackb(pack_events(encode_events(noted), 1.0), raw=False)
    [event] = batch[1]
    assert set(event) == {
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    }
    assert event["medium"] == "CPU" and event["token_ids"] == list(range(5, 13))


def test_a_snapshot_of_large_lineage_comes_in_pages_within_the_control_limit() -> None:
    """4,096 token ids a block (the most): 16 KiB of lineage each; 80 blocks are 1.3 MiB,
    more than one control message holds."""
    block_tokens = MAX_BLOCK_TOKENS
    config = ServerConfig(port=0, host_capacity=4 * 100 * (BB + 16640), handoff_ttl=0)
    with (
        CacheServer(config) as served,
        _client(served, block_tokens=block_tokens, name="large") as client,
    ):
        assert client.block_tokens == block_tokens and client.capacity_blocks >= 80
        ks = keys(0, 80)
        lineage = [Lineage.of(None, [n] * block_tokens) for n in range(80)]
        client.put(ks, payloads(ks, BB), lineage=lineage)
        snapshot = client.snapshot(lineage=True)
        kept = dict(zip(snapshot.keys, snapshot.lineage or [], strict=True))
        assert [kept[k] for k in ks] == lineage
