"""``StoreClient.deadline`` belongs to the thread or asyncio task that entered it: another
caller of the same client never inherits it, and one caller leaving its block never clears
another's. A deadline of 0 has passed when the block starts: every call inside it times out."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from helpers import keys, payloads

from kvbridge.store import CacheServer, ServerConfig, StoreClient

BB = 64 << 10


@pytest.fixture
def client() -> Iterator[StoreClient]:
    with (
        CacheServer(ServerConfig(port=0, host_capacity=8 << 20)) as server,
        StoreClient(server.address, block_bytes=BB, namespace="m") as client,
    ):
        client.put(keys(0, 2), payloads(keys(0, 2), BB))
        yield client


def test_another_thread_does_not_inherit_a_deadline(client: StoreClient) -> None:
    inside, leave = threading.Event(), threading.Event()
    seen: list[BaseException] = []

    def holder() -> None:
        with client.deadline(0):
            inside.set()
            leave.wait(30)
            try:
                client.match_prefix(keys(0, 2))
            except TimeoutError as exc:
                seen.append(exc)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert inside.wait(30)
        assert client.match_prefix(keys(0, 2)) == 2  # no deadline here: answered
    finally:
        leave.set()
        thread.join()
    assert len(seen) == 1  # the holder's own call is still bound by its deadline


def test_one_caller_leaving_its_block_keeps_anothers_deadline(client: StoreClient) -> None:
    entered, left = threading.Event(), threading.Event()

    def other() -> None:
        with client.deadline(60):
            entered.set()
        left.set()

    with client.deadline(0):
        thread = threading.Thread(target=other)
        thread.start()
        assert entered.wait(30) and left.wait(30)
        thread.join()
        with pytest.raises(TimeoutError, match="deadline"):
            client.match_prefix(keys(0, 2))
    assert client.match_prefix(keys(0, 2)) == 2  # the block is left: no deadline


def test_asyncio_tasks_keep_their_own_deadlines(client: StoreClient) -> None:
    async def main() -> tuple[BaseException | int, int]:
        inside, leave = asyncio.Event(), asyncio.Event()

        async def bounded() -> BaseException | int:
            with client.deadline(0):
                inside.set()
                await leave.wait()
                try:
                    return await client.amatch_prefix(keys(0, 2))
                except TimeoutError as exc:
                    return exc

        task = asyncio.create_task(bounded())
        await inside.wait()
        free = await client.amatch_prefix(keys(0, 2))  # another task: no deadline
        leave.set()
        return await task, free

    bounded, free = asyncio.run(main())
    assert free == 2
    assert isinstance(bounded, TimeoutError)


def test_nested_deadlines_keep_the_earlier(client: StoreClient) -> None:
    with client.deadline(0), client.deadline(60), pytest.raises(TimeoutError):
        client.match_prefix(keys(0, 2))
