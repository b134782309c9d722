"""The cluster client's zero-copy surface on real ``kvbridge serve --cluster`` processes:
pages of registered buffers (a KV cache's layers) go to the members that own their keys
and come back byte for byte; pins hold on every member that has a key; a member killed
under a call is noticed by that call within a second (its keys are misses, its replicated
heads still load); bad input is a typed error before any member is asked."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import pytest
from etcd_support import EtcdProcess, needs_etcd, until
from serve import TRANSPORTS, ServeProcess, needs_ucx

from kvbridge.store import BlockNotFound, ClusterClient, InvalidBlock, StoreClient, prefix_hashes
from kvbridge.transfer import LocalProtocolError

pytestmark = needs_etcd

BB = 8192
PAGES = 2  # a block is one page in each of two "layers"
TIMEOUT = 20.0
"""Long on purpose: a call that met a killed member and waited this out fails the bound."""


def _members(etcd: EtcdProcess) -> list[ServeProcess]:
    return [
        ServeProcess(
            *("--cluster", etcd.url, "--cluster-name", "z", "--host-capacity", "128MiB"),
            *("--handoff-ttl", "0", "--max-namespaces", "8", "--transports", "tcp,ucx"),
        )
        for _ in range(3)
    ]


@pytest.fixture(scope="module")
def members() -> Iterator[tuple[str, list[ServeProcess]]]:
    """One etcd and three members for the module's tests (each its own namespace)."""
    with EtcdProcess() as etcd:
        servers = _members(etcd)
        try:
            yield etcd.url, servers
        finally:
            for server in servers:
                server.kill()


@pytest.fixture(params=TRANSPORTS)
def cluster(
    request: pytest.FixtureRequest, members: tuple[str, list[ServeProcess]]
) -> Iterator[_Case]:
    """A client of the members, in a namespace of the test's own."""
    url, servers = members
    with _client(url, request.param, request.node.name) as client:
        until(lambda: len(client.members()) == 3)
        yield _Case(client, servers, request.node.name)


class _Case(NamedTuple):
    client: ClusterClient
    servers: list[ServeProcess]
    namespace: str


def _client(url: str, transport: str = "tcp", namespace: str = "killed") -> ClusterClient:
    return ClusterClient(
        url,
        block_bytes=BB,
        namespace=namespace,
        cluster="z",
        timeout=TIMEOUT,
        replicated_blocks=4,
        transports=transport,
        connections=2,
    )


class _Layers:
    """Two "layers" of ``slots`` pages each, a block's pages at the same slot in both."""

    def __init__(self, client: ClusterClient, slots: int, seed: int | None = None) -> None:
        rng = np.random.default_rng(seed)
        page = BB // PAGES
        self.arrays = [
            rng.integers(0, 256, slots * page, dtype=np.uint8)
            if seed is not None
            else np.zeros(slots * page, np.uint8)
            for _ in range(PAGES)
        ]
        self.regions = [client.register(a) for a in self.arrays]

    def offsets(self, slots: list[int]) -> np.ndarray:
        return np.repeat(np.asarray(slots, np.int64)[:, None] * (BB // PAGES), PAGES, axis=1)

    def block(self, slot: int) -> bytes:
        page = BB // PAGES
        return b"".join(a[slot * page : (slot + 1) * page].tobytes() for a in self.arrays)


@pytest.mark.slow
def test_pages_round_trip_byte_for_byte_across_members(
    cluster: _Case,
) -> None:
    client, servers, ns = cluster
    keys = prefix_hashes(range(16 * 60), 16)
    source, target = _Layers(client, 80, seed=1), _Layers(client, 80)
    at, to = list(range(79, 19, -1)), [(7 * i) % 80 for i in range(60)]  # scattered, distinct
    assert all(client.put_pages(keys, source.regions, source.offsets(at)))
    client.get_pages(keys, target.regions, target.offsets(to))
    for i in range(60):
        assert target.block(to[i]) == source.block(at[i])
    held = [_held(server, ns) for server in servers]
    assert all(h > 0 for h in held) and sum(held) == 60 + 4  # 4 heads on two members
    out = np.empty(BB, np.uint8)  # the copying path reads the same bytes
    client.get(keys[30:31], out)
    assert out.tobytes() == source.block(at[30])


def test_one_buffer_put_from_and_get_into(
    cluster: _Case,
) -> None:
    client, _, _ = cluster
    keys = prefix_hashes(range(16 * 12), 16)
    data = np.random.default_rng(2).integers(0, 256, 12 * BB, dtype=np.uint8)
    back = np.zeros_like(data)
    into, out = client.register(data), client.register(back)
    offsets = [(11 - i) * BB for i in range(12)]
    assert all(client.put_from(keys, into, offsets))
    assert client.put_from(keys, into, offsets) == [False] * 12  # already there: not sent
    client.get_into(keys, out, offsets)
    assert back.tobytes() == data.tobytes()


def test_pins_hold_on_every_member_until_released(
    cluster: _Case,
) -> None:
    """A pinned block survives its member's ``clear`` (which drops what no reader holds)."""
    client, servers, ns = cluster
    keys = prefix_hashes(range(16 * 30), 16)
    client.put(keys, np.ones(30 * BB, np.uint8))
    lease = client.pin(keys)
    for server in servers:
        with _direct(server, ns) as member:
            assert member.server_stats()["server"]["open_leases"] > 0  # each holds some
            member.clear()
    assert client.match_prefix(keys) == 30
    lease.release()
    for server in servers:
        with _direct(server, ns) as member:
            member.clear()
    assert client.contains(keys) == [False] * 30


def test_a_pin_of_a_missing_key_pins_nothing(
    cluster: _Case,
) -> None:
    client, servers, ns = cluster
    keys = prefix_hashes(range(16 * 10), 16)
    client.put(keys[:9], np.ones(9 * BB, np.uint8))
    with pytest.raises(BlockNotFound) as caught:
        client.pin(keys)
    assert list(caught.value.keys) == [keys[9]]
    for server in servers:
        with _direct(server, ns) as member:
            member.clear()
    assert client.contains(keys) == [False] * 10  # nothing was left pinned


def test_bad_pages_are_refused_before_any_member_is_asked(
    cluster: _Case,
) -> None:
    client, servers, ns = cluster
    layers = _Layers(client, 4, seed=3)
    keys = prefix_hashes(range(16 * 4), 16)
    with pytest.raises(InvalidBlock):
        client.put_pages(keys, layers.regions, layers.offsets([0, 1, 2]))  # 3 rows, 4 keys
    with pytest.raises(InvalidBlock):
        client.put_pages(keys, layers.regions, layers.offsets([0, 1, 2, 4]))  # past the end
    with _client(client_url(servers), namespace=ns) as other:
        foreign = other.register(np.zeros(4 * BB, np.uint8))
        with pytest.raises(InvalidBlock):
            client.put_from(keys, foreign, [0, BB, 2 * BB, 3 * BB])
    assert client.contains(keys) == [False] * 4
    assert sum(_held(server, ns) for server in servers) == 0


@pytest.mark.slow
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_member_killed_under_a_load_is_noticed_at_once(transport: str) -> None:
    """Loads run back to back; a member is SIGKILLed under them: the load in flight returns
    within a second or so (not the 20 s timeout), later loads miss only that member's keys
    past the replicated heads, and nothing raises but ``BlockNotFound``."""
    with EtcdProcess() as etcd:
        servers = _members(etcd)
        try:
            with _client(etcd.url, transport) as client, _client(etcd.url, "tcp", "o") as other:
                until(lambda: len(client.members()) == len(other.members()) == 3)
                _kill_under_loads(client, other, servers)
        finally:
            for server in servers:
                server.kill()


def _kill_under_loads(
    client: ClusterClient, other: ClusterClient, servers: list[ServeProcess]
) -> None:
    """``other``: a client of another namespace that never called the member."""
    keys = prefix_hashes(range(16 * 60), 16)
    source, target = _Layers(client, 60, seed=4), _Layers(client, 60)
    client.put_pages(keys, source.regions, source.offsets(list(range(60))))
    outcomes: list[tuple[float, BaseException | None]] = []
    stop = threading.Event()

    def loads() -> None:
        while not stop.is_set():
            try:
                client.get_pages(keys, target.regions, target.offsets(list(range(60))))
                outcomes.append((time.monotonic(), None))
            except BlockNotFound as exc:
                outcomes.append((time.monotonic(), exc))

    thread = threading.Thread(target=loads)
    thread.start()
    until(lambda: len(outcomes) >= 2)
    servers[0].kill()
    killed = time.monotonic()
    until(lambda: any(t > killed and e is not None for t, e in outcomes), timeout=TIMEOUT)
    with pytest.raises(ConnectionError, match=servers[0].address):
        other.clear()  # etcd still lists it (its lease runs 3 s): not cleared is a failure
    stop.set()
    thread.join(TIMEOUT)
    first_miss = min(t for t, e in outcomes if t > killed and e is not None)
    assert first_miss - killed < 3.0  # measured 0.1-0.2 s; the timeout is 20 s
    assert servers[0].address not in client.members()
    assert client.match_prefix(keys) >= 4  # the replicated heads survive the member
    heads = _Layers(client, 4)
    client.get_pages(keys[:4], heads.regions, heads.offsets([0, 1, 2, 3]))
    assert [heads.block(i) for i in range(4)] == [source.block(i) for i in range(4)]


def test_nothing_to_move_is_no_call(cluster: _Case) -> None:
    client, _, _ = cluster
    assert client.put([], np.empty(0, np.uint8)) == []
    client.get([], np.empty(0, np.uint8))
    client.get_pages([], [client.register(np.empty(BB, np.uint8))], np.empty((0, 1), np.int64))


class _FakeGpuMemory:
    """Claims to be GPU memory; this process cannot register it (no cupy, no device)."""

    nbytes = 4 * BB

    @property
    def __cuda_array_interface__(self) -> dict[str, object]:
        return {"shape": (4 * BB,), "typestr": "|u1", "data": (0, False), "version": 3}


@needs_ucx
def test_gpu_memory_this_process_cannot_register_is_refused_at_once(
    members: tuple[str, list[ServeProcess]],
) -> None:
    """``LocalProtocolError`` from ``register`` (where a connector stages instead), not a
    failure of every member at the first load; the client goes on with host memory."""
    url, _ = members
    with _client(url, "ucx", "fake-gpu") as client:
        until(lambda: len(client.members()) == 3)
        with pytest.raises(LocalProtocolError):
            client.register(_FakeGpuMemory())
        data = np.arange(4 * BB, dtype=np.uint64).view(np.uint8)[: 4 * BB].copy()
        keys = prefix_hashes(range(16 * 4), 16)
        assert all(client.put_from(keys, client.register(data), [0, BB, 2 * BB, 3 * BB]))
        assert len(client.members()) == 3  # no member was taken for failed


def client_url(servers: list[ServeProcess]) -> str:
    """The etcd URL the members were started with (from their command line)."""
    args = servers[0].proc.args
    assert isinstance(args, list)
    return str(args[args.index("--cluster") + 1])


def _direct(server: ServeProcess, namespace: str) -> StoreClient:
    return StoreClient(server.address, block_bytes=BB, namespace=namespace)


def _held(server: ServeProcess, namespace: str) -> int:
    with _direct(server, namespace) as member:
        return sum(t.blocks for t in member.stats().tiers)
