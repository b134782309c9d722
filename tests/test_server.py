"""The cache server end to end: a real `kvbridge serve` process (or a ``CacheServer`` in this
process) and StoreClients, over TCP and over UCX."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from attack import raw, write_ops
from helpers import FakeClock, keys, payloads, until
from serve import BLOCK, TRANSPORTS, ServeProcess, client_of, small_server, two_sided

from kvbridge.store import (
    BadRequest,
    BlockNotFound,
    CacheServer,
    ServerConfig,
    StoreClient,
    StoreFull,
    TieredStore,
    TooManyRequests,
    UnknownNamespace,
)
from kvbridge.transfer import OP_DTYPE, PeerClosed, TransferError, ucx_available

BB = BLOCK  # client_of's block size


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def server(transport: str) -> Iterator[ServeProcess]:
    s = ServeProcess(
        *("--host-capacity", "16MiB", "--max-namespaces", "2", "--lease-ttl", "30"),
        *("--transports", transport),
    )
    yield s
    if s.proc.poll() is None:
        s.stop(signal.SIGKILL)


@pytest.mark.slow
def test_push_from_one_client_pull_from_another_with_dedup(
    server: ServeProcess, transport: str
) -> None:
    ks = keys(0, 40)
    data = payloads(ks, BB)
    with (
        client_of(server, "llama", transport) as prefill,
        client_of(server, "llama", transport) as decode,
    ):
        assert prefill.put(ks[:30], data[:30]) == [True] * 30
        assert decode.match_prefix(ks) == 30
        assert prefill.put(ks, data) == [False] * 30 + [True] * 10  # only 10 sent
        assert prefill.counters["bytes_saved"] == 30 * BB
        assert prefill.counters["bytes_pushed"] == 40 * BB
        out = np.zeros_like(data)
        decode.get(ks, out)
        np.testing.assert_array_equal(out, data)
        blocks = [np.zeros(BB, np.uint8) for _ in range(3)]  # a list of buffers works too
        decode.get(ks[5:8], blocks)
        np.testing.assert_array_equal(np.stack(blocks), data[5:8])
        stats = decode.stats()
        assert stats.puts == 40 and stats.duplicates == 30 and stats.hits == 43


@pytest.mark.slow
def test_zero_copy_variants_move_registered_regions(server: ServeProcess, transport: str) -> None:
    ks = keys(100, 108)
    data = payloads(ks, BB)
    with client_of(server, "llama", transport) as client:
        src = client.register(data.reshape(-1), access="r")
        offsets = [i * BB for i in range(8)][::-1]  # any placement in the region
        client.put_from(ks, src, offsets)
        dst_buffer = np.zeros(8 * BB, np.uint8)
        dst = client.register(dst_buffer)
        client.get_into(ks, dst, offsets)
        np.testing.assert_array_equal(dst_buffer, data.reshape(-1))


@pytest.mark.slow
def test_missing_blocks_and_bad_requests_are_typed_and_change_nothing(
    server: ServeProcess, transport: str
) -> None:
    ks = keys(200, 204)
    with client_of(server, "m", transport) as client:
        client.put(ks[:2], payloads(ks[:2], BB))
        out = np.full((4, BB), 7, np.uint8)
        with pytest.raises(BlockNotFound) as missing:
            client.get(ks, out)
        assert set(missing.value.keys) == set(ks[2:])
        assert (out == 7).all()  # untouched
        with pytest.raises(BadRequest):
            raw(client).call({"op": "nope"})
        with pytest.raises(UnknownNamespace):
            raw(client).call({"op": "match", "ns": 99, "keys": []})
        with pytest.raises(BadRequest):
            StoreClient(server.address, block_bytes=BB * 2, namespace="m", transports=transport)
        assert client.contains(ks) == [True, True, False, False]


@pytest.mark.slow
def test_a_client_cannot_write_outside_its_staged_slots(
    server: ServeProcess, transport: str
) -> None:
    two_sided(transport)
    ks = keys(300, 302)
    with client_of(server, "m", transport) as client:
        client.put(ks[:1], payloads(ks[:1], BB))
        junk = client.register(np.full(BB, 0xEE, np.uint8))
        ops = np.zeros(1, OP_DTYPE)
        ops["local_region"], ops["remote_region"] = junk.id, raw(client).region
        ops["remote_offset"], ops["length"] = 0, BB  # slot 0 holds a committed block
        with pytest.raises(TransferError, match="refuses"):
            client.peer.write(ops).wait(5)
        out = np.zeros((1, BB), np.uint8)
        client.get(ks[:1], out)
        np.testing.assert_array_equal(out, payloads(ks[:1], BB))


_HOLD_LEASES = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, sys.argv[5])  # the tests' folder: attack.py
    from attack import raw
    from kvbridge.store import StoreClient
    client = StoreClient(
        sys.argv[1], block_bytes=int(sys.argv[2]), namespace="m", transports=sys.argv[4]
    )
    keys = [i.to_bytes(32, "little") for i in range(int(sys.argv[3]))]
    step, held = client.request_keys, 0
    for start in range(0, len(keys), step):  # as much as the server lets one session hold
        try:
            chunk = keys[start : start + step]
            reply = raw(client).op("stage", keys=chunk)
        except Exception as exc:
            print(held, type(exc).__name__, flush=True)
            break
        held += sum(slot is not None for slot in reply["slots"])
    time.sleep(60)
    """
)


@pytest.mark.slow
def test_one_client_holds_at_most_its_share_and_a_killed_ones_leases_end_with_it(
    transport: str,
) -> None:
    """A client that stages everything it can gets half of the namespace at most; when it is
    killed, its session ends with its streams and its slots come back, long before its
    leases would expire: at once over TCP (the kernel closes its sockets), over UCX (which
    tells a peer nothing) once its streams miss three keepalives (0.5 s here)."""
    server = ServeProcess(
        *("--host-capacity", "16MiB", "--max-namespaces", "2", "--lease-ttl", "60"),
        *("--transports", transport, "--keepalive", "0.5"),
    )
    capacity = (16 << 20) // 2 // BB  # the namespace's share of host memory, in blocks
    try:
        holder = subprocess.Popen(
            [
                *(sys.executable, "-c", _HOLD_LEASES, server.address, str(BB), str(capacity)),
                *(transport, str(Path(__file__).parent)),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert holder.stdout is not None
        held, refusal = holder.stdout.readline().split()
        assert int(held) == capacity // 2 and refusal == "TooManyRequests"
        with client_of(server, "m", transport) as client:
            assert client.server_stats()["server"]["open_leases"] == 2
            ks = keys(400, 400 + capacity // 2)
            client.put(ks, payloads(ks, BB))  # the other half is there for everyone else
            holder.kill()
            holder.wait()
            until(
                lambda: client.server_stats()["server"]["open_leases"] == 0,
                "the killed client's leases ended with its session (not 60 s later)",
            )
            more = keys(1000, 1000 + capacity // 2)
            client.put(more, payloads(more, BB))
            assert client.match_prefix(ks) + client.match_prefix(more) == capacity
    finally:
        server.stop(signal.SIGKILL)


def test_too_many_open_leases_is_refused(transport: str) -> None:
    config = ServerConfig(
        port=0, host_capacity=8 << 20, max_leases_per_client=2, transports=(transport,)
    )
    with (
        CacheServer(config) as server,
        client_of(server, "m", transport) as client,
    ):
        leases = [raw(client).op("stage", keys=keys(i, i + 1))["lease"] for i in range(2)]
        with pytest.raises(TooManyRequests):
            client.put(keys(10, 11), payloads(keys(10, 11), BB))
        raw(client).op("abort", lease=leases[0])
        client.put(keys(10, 11), payloads(keys(10, 11), BB))  # room for one lease again
        assert client.contains(keys(0, 2) + keys(10, 11)) == [False, False, True]


def test_everything_pinned_means_store_full_fast(transport: str) -> None:
    config = ServerConfig(port=0, host_capacity=4 * BB, max_namespaces=1, transports=(transport,))
    with (
        CacheServer(config) as server,
        client_of(server, "m", transport) as client,
    ):
        ks = keys(0, 5)
        client.put(ks[:4], payloads(ks[:4], BB))
        with (
            client_of(server, "m", transport) as one,
            client_of(server, "m", transport) as two,
            StoreClient(
                server.address, block_bytes=BB, namespace="m", transports=transport, timeout=5
            ) as third,
        ):
            for holder, key in zip((one, one, two, two), ks[:4], strict=True):
                raw(holder).op("pin", keys=[key])  # each its share
            with pytest.raises(StoreFull):  # refused: queued, it would time out (PeerClosed)
                third.put(ks[4:], payloads(ks[4:], BB))
        assert client.contains(ks) == [True] * 4 + [False]
        client.put(ks[4:], payloads(ks[4:], BB))  # the holders are gone: so are their pins


@pytest.mark.slow
def test_restart_on_the_same_disk_serves_the_same_blocks(tmp_path: Path, transport: str) -> None:
    args = (
        *("--host-capacity", "4MiB", "--disk-path", str(tmp_path), "--disk-capacity", "64MiB"),
        *("--transports", transport),
    )
    ks = keys(0, 100)  # more than host memory holds: most are on disk only
    data = payloads(ks, BB)
    first = ServeProcess(*args)
    try:
        with client_of(first, "m", transport) as client:
            client.put(ks, data)
    finally:
        assert "stopped" in first.stop(signal.SIGTERM)
    assert first.proc.returncode == 0
    second = ServeProcess(*args)
    try:
        with client_of(second, "m", transport) as client:
            assert client.match_prefix(ks) == 100
            out = np.zeros_like(data)
            client.get(ks, out)
            np.testing.assert_array_equal(out, data)
    finally:
        second.stop(signal.SIGKILL)


@pytest.mark.slow
def test_a_killed_server_loses_no_committed_block(tmp_path: Path, transport: str) -> None:
    args = (
        *("--host-capacity", "4MiB", "--disk-path", str(tmp_path), "--disk-capacity", "64MiB"),
        *("--transports", transport),
    )
    ks = keys(0, 20)
    first = ServeProcess(*args)
    try:
        with client_of(first, "m", transport) as client:
            client.put(ks, payloads(ks, BB))
    finally:
        first.stop(signal.SIGKILL)
    second = ServeProcess(*args)
    try:
        with client_of(second, "m", transport) as client:
            out = np.zeros((20, BB), np.uint8)
            client.get(ks, out)
            np.testing.assert_array_equal(out, payloads(ks, BB))
    finally:
        second.stop(signal.SIGKILL)


@pytest.mark.slow
def test_stats_command_prints_the_table(server: ServeProcess, transport: str) -> None:
    with client_of(server, "llama", transport) as client:
        client.put(keys(0, 2), payloads(keys(0, 2), BB))
    done = subprocess.run(
        [sys.executable, "-m", "kvbridge", "stats", "--transports", transport, server.address],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    # The stats client opened no namespace: it sees the figures, not the tenant's name.
    assert "llama" not in done.stdout and "host" in done.stdout
    assert f"sha256:{hashlib.sha256(b'llama').hexdigest()[:12]}/65536" in done.stdout


@pytest.mark.slow
def test_code_written_for_tieredstore_runs_against_a_server(
    server: ServeProcess, transport: str
) -> None:
    def workload(store: TieredStore | StoreClient) -> list[object]:
        ks = keys(600, 610)
        results: list[object] = [store.put(ks[:5], payloads(ks[:5], BB))]
        results.append(store.match_prefix(ks))
        results.append(store.contains(ks[3:7]))
        out = np.zeros((5, BB), np.uint8)
        store.get(ks[:5], out)
        results.append(bool((out == payloads(ks[:5], BB)).all()))
        results.append(store.remove(ks[4:6]))
        results.append(store.match_prefix(ks))
        return results

    with TieredStore(BB, host_capacity=8 << 20) as local:
        expected = workload(local)
    with client_of(server, "same", transport) as remote:
        assert workload(remote) == expected


@pytest.mark.slow
def test_async_twins(server: ServeProcess, transport: str) -> None:
    import asyncio  # noqa: PLC0415

    async def main() -> None:
        with client_of(server, "m", transport) as client:
            ks = keys(700, 704)
            await client.aput(ks, payloads(ks, BB))
            assert await client.amatch_prefix(ks) == 4
            out = np.zeros((4, BB), np.uint8)
            await client.aget(ks, out)
            np.testing.assert_array_equal(out, payloads(ks, BB))

    asyncio.run(main())


def test_a_put_whose_lease_expired_is_refused_and_stores_nothing(transport: str) -> None:
    clock = FakeClock()
    config = ServerConfig(port=0, host_capacity=8 << 20, lease_ttl=5.0, transports=(transport,))
    with (
        CacheServer(config, clock=clock) as server,
        client_of(server, "m", transport) as client,
    ):
        ks = keys(0, 2)
        staged = raw(client).op("stage", keys=ks)
        clock.advance(5.0)  # the lease is over, with no sleep
        src = client.register(payloads(ks, BB).reshape(-1), access="r")
        ops = write_ops(client, src, staged["slots"])
        commit = msgpack.packb({"op": "commit", "ns": raw(client).ns, "lease": staged["lease"]})
        with pytest.raises(TransferError, match=r"LeaseExpired|refuses"):
            client.peer.write(ops, notify=commit).wait(5)
        assert client.contains(ks) == [False, False]
        client.put(ks, payloads(ks, BB))  # a fresh lease works
        assert client.contains(ks) == [True, True]


@pytest.mark.parametrize("handoff", [5.0, 0.0])
def test_pushed_blocks_are_held_for_their_first_read(handoff: float, transport: str) -> None:
    config = ServerConfig(
        port=0,
        host_capacity=8 * BB,
        max_namespaces=1,
        policy="reuse",
        handoff_ttl=handoff,
        transports=(transport,),
    )
    with (
        CacheServer(config) as server,
        client_of(server, "m", transport) as client,
    ):
        ks = keys(0, 10)
        out = np.zeros((4, BB), np.uint8)
        client.put(ks[:4], payloads(ks[:4], BB))
        client.get(ks[:4], out)  # read once: reused, and no longer held
        client.put(ks[4:6], payloads(ks[4:6], BB))  # pushed, not yet pulled
        client.put(ks[6:10], payloads(ks[6:10], BB))  # needs two evictions
        held = client.contains(ks[4:6])
        if handoff:
            assert held == [True, True]  # the older, reused blocks went instead
            assert client.contains(ks[:2]) == [False, False]
            client.get(ks[4:6], out[:2])  # the first read releases the hold
            np.testing.assert_array_equal(out[:2], payloads(ks[4:6], BB))
            client.put(keys(20, 21), payloads(keys(20, 21), BB))
            assert client.remove(keys(20, 21)) == [True]  # a held block can still be removed
        else:
            assert held == [False, False]  # `reuse` drops never-read blocks first


def _port_of(server: ServeProcess) -> str:
    return server.address.rsplit(":", 1)[1]


@pytest.mark.slow
def test_after_a_restart_a_client_opens_its_namespace_again_first_time(transport: str) -> None:
    """Another client opened its namespace first on the restarted server: the first call
    carries the new session's handle (not the old one), and is answered."""
    first = ServeProcess("--host-capacity", "4MiB", "--transports", transport)
    port = _port_of(first)
    with client_of(first, "a", transport) as client:
        client.put(keys(0, 2), payloads(keys(0, 2), BB))
        first.stop(signal.SIGKILL)
        again = ServeProcess("--port", port, "--host-capacity", "4MiB", "--transports", transport)
        try:
            with client_of(again, "b", transport) as other:
                other.put(keys(5, 6), payloads(keys(5, 6), BB))
                assert client.contains(keys(0, 2)) == [False, False]  # empty, not an error
                assert client.contains(keys(5, 6)) == [False]  # never b's blocks
        finally:
            again.kill()


@pytest.mark.slow
def test_a_refused_reopen_is_tried_again_on_the_next_call(transport: str) -> None:
    """The restarted server is full (one namespace, held by another session) when the
    client comes back: that call fails; once there is room, the next call opens the
    namespace again instead of sending a handle the server does not know."""
    args = ("--host-capacity", "4MiB", "--max-namespaces", "1", "--transports", transport)
    first = ServeProcess(*args)
    port = _port_of(first)
    with client_of(first, "a", transport) as client:
        client.put(keys(0, 2), payloads(keys(0, 2), BB))
        first.stop(signal.SIGKILL)
        again = ServeProcess("--port", port, *args)
        try:
            other = client_of(again, "b", transport)
            with pytest.raises(StoreFull):
                client.contains(keys(0, 2))
            other.close()  # its session ends once the server sees its streams close
            put: list[list[bool]] = []

            def reopened() -> bool:  # a handle the server does not know would raise here
                try:
                    put.append(client.put(keys(0, 2), payloads(keys(0, 2), BB)))
                except StoreFull:  # "b" not idle yet: refused, nothing changed
                    return False
                return True

            until(reopened, "the namespace was opened again once 'b' made room")
            assert put == [[True, True]]
            assert client.contains(keys(0, 2)) == [True, True]
        finally:
            again.kill()


@pytest.mark.slow
def test_a_deadline_bounds_a_call_of_many_requests(
    monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    """Every request is answered within the timeout but takes 0.3 s (of the client's fake
    clock): a put of several requests takes their sum; under ``deadline(0.5)`` it gives up
    at 0.5 s instead, the request that would run past it getting only what was left."""
    server = small_server(transport)
    clock = FakeClock()
    try:
        with StoreClient(
            server.address, block_bytes=BLOCK, namespace="m", transports=transport, clock=clock
        ) as client:
            answer = client.peer.call
            waits: list[float] = []

            def slow(body: dict[str, Any], timeout: float) -> dict[str, Any]:
                waits.append(timeout)
                if timeout < 0.3:
                    clock.advance(timeout)
                    raise PeerClosed(f"no answer within {timeout:.2f} s")
                clock.advance(0.3)
                return answer(body, timeout=timeout)

            monkeypatch.setattr(client.peer, "call", slow)
            ks = keys(0, 12)
            requests = -(-len(ks) // client.request_keys)
            assert requests >= 3
            started = clock()
            assert client.put(ks[:6], payloads(ks[:6], BB)) == [True] * 6
            assert clock() - started >= 0.3 * -(-6 // client.request_keys)
            started, waits[:] = clock(), []
            with pytest.raises((TimeoutError, PeerClosed)), client.deadline(0.5):
                client.put(ks[6:], payloads(ks[6:], BB))
            # the first request had the whole 0.5 s, the next what was left; then giving the
            # staged lease back had its courtesy 0.1 s: nothing ran a request's 0.3 s past it
            assert waits == pytest.approx([0.5, 0.2, 0.1])
            assert clock() - started == pytest.approx(0.6)
            monkeypatch.undo()
            assert client.contains(ks[:6]) == [True] * 6  # the client works on
    finally:
        server.kill()


def test_clear_empties_one_namespace_and_spares_a_readers_pin(transport: str) -> None:
    config = ServerConfig(
        port=0, host_capacity=32 * BB, max_namespaces=2, handoff_ttl=30, transports=(transport,)
    )
    with (
        CacheServer(config) as server,
        client_of(server, "a", transport) as a,
        client_of(server, "a", transport) as reader,
        client_of(server, "b", transport) as b,
    ):
        ks = keys(0, 6)
        a.put(ks, payloads(ks, BB))  # pushed: held for their first read (handoff)
        b.put(ks, payloads(ks, BB))
        lease = reader.pin(ks[:1])
        assert a.clear() == 5  # held ones too; not the one a reader pinned
        assert a.contains(ks) == [True] + [False] * 5
        out = np.zeros(BB, np.uint8)
        reader.get(ks[:1], out)  # the pinned block is still whole
        np.testing.assert_array_equal(out, payloads(ks[:1], BB)[0])
        lease.release()
        assert b.match_prefix(ks) == 6  # another namespace is untouched
        assert a.put(ks, payloads(ks, BB)) == [False] + [True] * 5


@pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed (kvbridge[ucx])")
def test_a_client_over_ucx() -> None:
    config = ServerConfig(port=0, host_capacity=8 << 20, transports=("ucx", "tcp"))
    with (
        CacheServer(config) as server,
        StoreClient(server.address, block_bytes=BB, namespace="m", transports="ucx") as client,
    ):
        assert client.peer.transport == "ucx"
        ks = keys(0, 8)
        client.put(ks, payloads(ks, BB))
        out = np.zeros((8, BB), np.uint8)
        client.get(ks, out)
        np.testing.assert_array_equal(out, payloads(ks, BB))
