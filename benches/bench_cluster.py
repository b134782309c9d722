"""A cluster of ``kvbridge serve`` processes on etcd against one server, same client.

- Throughput: one ``ClusterClient`` pushes then pulls 64 requests of 4 MiB (1 MiB blocks)
  through a three-member cluster; baseline: the same client code against a one-member
  cluster. On a 2-core machine this shows what the fan-out costs, not scaling.
- ``match_prefix`` of 1,000 keys through the cluster (one parallel round of ``contains``)
  against a ``StoreClient.match_prefix`` of one server.
- The connector core's page-wise loads and saves (1 MiB blocks of 8 pages of 128 KiB, as
  ``bench_connector.py``) through the three members against the same core on one server,
  the same bytes: blocks past a chain's replicated head (one copy each), and a chain's
  first blocks (two copies: the save moves twice the bytes).
- Failover: after SIGKILL of a member, how long a call in flight to it took to return (the
  member's connection drops under it), and when new calls left the member out.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import _EXTRA_LINES

from kvbridge.bindings import ConnectorConfig, ConnectorCore, Identity, PagedKV
from kvbridge.store import ClusterClient, StoreClient, prefix_hashes
from kvbridge.tools._etcd_process import EtcdProcess, etcd_binary
from kvbridge.tools._serve_cmds import read_listening

try:
    etcd_binary()
except FileNotFoundError as exc:
    pytest.skip(f"no etcd: {exc}", allow_module_level=True)

BB = 1 << 20
PER = 4
REQUESTS = 64


def _serve(etcd: EtcdProcess, name: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "kvbridge", "serve", "--port", "0"),
            *("--cluster", etcd.url, "--cluster-name", name, "--host-capacity", "1GiB"),
            *("--max-namespaces", "2", "--handoff-ttl", "0"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    return proc, read_listening(proc.stdout)[0]


@pytest.fixture(scope="module")
def clusters() -> Iterator[tuple[EtcdProcess, list[tuple[subprocess.Popen[str], str]]]]:
    with EtcdProcess() as etcd:
        servers = [_serve(etcd, "three") for _ in range(3)] + [_serve(etcd, "one")]
        try:
            yield etcd, servers
        finally:
            for proc, _ in servers:
                proc.kill()
                proc.wait()


def _client(etcd: EtcdProcess, name: str, members: int) -> ClusterClient:
    client = ClusterClient(etcd.url, block_bytes=BB, namespace="bench", cluster=name)
    deadline = time.monotonic() + 15
    while len(client.members()) < members:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return client


def test_three_members_against_one(compare: Callable[..., Any], clusters: Any) -> None:
    etcd, _ = clusters
    data = np.random.default_rng(0).integers(0, 256, (REQUESTS, PER * BB), dtype=np.uint8)
    out = np.empty((PER * BB,), np.uint8)
    rounds = iter(range(10**6))
    with _client(etcd, "three", 3) as three, _client(etcd, "one", 1) as one:

        def run(client: ClusterClient) -> None:
            r = next(rounds)
            keys = [
                prefix_hashes(range(r * 10**6 + q * 1000, r * 10**6 + q * 1000 + PER * 16), 16)
                for q in range(REQUESTS)
            ]
            for q in range(REQUESTS):
                client.put(keys[q], data[q])
            for q in range(REQUESTS):
                client.get(keys[q], out)
            for q in range(REQUESTS):  # room for the next round
                client.remove(keys[q])

        compare(
            f"cluster of 3, {REQUESTS} x 4 MiB push+pull",
            lambda: run(three),
            lambda: run(one),
            baseline_name="the same through a cluster of 1",
            nbytes=2 * REQUESTS * PER * BB,
            rounds=3,
            warmup=1,
        )


def test_match_prefix_latency(compare: Callable[..., Any], clusters: Any) -> None:
    etcd, servers = clusters
    keys = prefix_hashes(range(1000 * 16), 16)
    small, zeros = 4096, np.zeros(4096 * 1000, np.uint8)
    with (
        ClusterClient(etcd.url, block_bytes=small, namespace="match", cluster="three") as three,
        StoreClient(servers[3][1], block_bytes=small, namespace="match") as single,
    ):
        while len(three.members()) < 3:
            time.sleep(0.05)
        three.put(keys, zeros)
        single.put(keys, zeros)
        assert three.match_prefix(keys) == single.match_prefix(keys) == 1000
        compare(
            "cluster match_prefix, 1,000 keys, 3 members",
            lambda: three.match_prefix(keys),
            lambda: single.match_prefix(keys),
            baseline_name="StoreClient.match_prefix, one server",
            rounds=30,
        )


LAYERS, PAGE, BLOCKS = 8, 128 << 10, 16


@pytest.mark.parametrize("direction", ["load", "save"])
@pytest.mark.parametrize("start", [64, 0], ids=["past-the-heads", "heads"])
def test_connector_through_three_members(
    compare: Callable[..., Any], clusters: Any, direction: str, start: int
) -> None:
    etcd, servers = clusters
    _client(etcd, "three", 3).close()  # etcd lists all three: the cores see them
    cache = [np.random.default_rng(i).integers(0, 256, (64, PAGE), np.uint8) for i in range(LAYERS)]
    kv = PagedKV(tuple(cache), "bench")
    ids = tuple(range(BLOCKS))
    three = ConnectorConfig.from_extra({"server": etcd.url, "cluster_name": "three", "streams": 2})
    one = ConnectorConfig(server=servers[3][1])
    extra = f"{direction}-{start}"  # a namespace per case: nothing of another case is there
    ident = Identity("bench", "m", "float32", "cpu/8x64", 32, LAYERS * PAGE, "tp0/1", extra)
    rounds = iter(range(1, 10**6))
    with ConnectorCore(three, ident) as fanned, ConnectorCore(one, ident) as single:
        for core in (fanned, single):
            core.attach(kv)
        keys = fanned.keys(list(range(32 * BLOCKS)))
        assert fanned.save(keys, ids, start) and single.save(keys, ids, start)

        def move(core: ConnectorCore) -> Callable[[], object]:
            if direction == "load":
                return lambda: core.load(keys, ids, start) or pytest.fail("load failed")

            def save() -> None:  # new keys each round: every block moves
                base = next(rounds) << 20
                core.save(core.keys(list(range(base, base + 32 * BLOCKS))), ids, start)

            return save

        copies = 2 if start == 0 and direction == "save" else 1
        compare(
            f"connector {direction} via 3 members, {BLOCKS} x 1 MiB at block {start} "
            f"({copies} cop{'ies' if copies > 1 else 'y'})",
            move(fanned),
            move(single),
            baseline_name="the same core on one server",
            nbytes=BLOCKS * LAYERS * PAGE,
            rounds=10,
        )


def test_three_plain_clients_against_one(compare: Callable[..., Any], clusters: Any) -> None:
    """The floor under the cluster's figures on this machine: three ``StoreClient`` s, one
    per member, each reading a third of 16 MiB (1 MiB blocks) at once on three threads,
    against one ``StoreClient`` reading all of it from one server. No cluster code runs."""
    _, servers = clusters
    data = np.random.default_rng(1).integers(0, 256, 16 * BB, dtype=np.uint8)
    out = np.empty_like(data)
    keys = prefix_hashes(range(5 * 10**6, 5 * 10**6 + 16 * 32), 32)
    offsets = [i * BB for i in range(16)]
    parts = [list(range(0, 6)), list(range(6, 11)), list(range(11, 16))]
    members = [StoreClient(a, block_bytes=BB, namespace="plain") for _, a in servers[:3]]
    single = StoreClient(servers[3][1], block_bytes=BB, namespace="plain")
    pool = concurrent.futures.ThreadPoolExecutor(3)
    try:
        single.put(keys, data)
        for client, part in zip(members, parts, strict=True):
            client.put([keys[i] for i in part], np.ascontiguousarray(data.reshape(16, BB)[part]))
        regions = [client.register(out) for client in members]
        region = single.register(out)

        def three() -> None:
            reads = [
                pool.submit(c.get_into, [keys[i] for i in p], r, [offsets[i] for i in p])
                for c, p, r in zip(members, parts, regions, strict=True)
            ]
            for read in reads:
                read.result()

        compare(
            "3 StoreClients at once, a third of 16 x 1 MiB each",
            three,
            lambda: single.get_into(keys, region, offsets),
            baseline_name="one StoreClient, all of it",
            nbytes=16 * BB,
        )
    finally:
        pool.shutdown()
        for client in [*members, single]:
            client.close()


def test_time_to_leave_a_killed_member_out(clusters: Any) -> None:
    """After SIGKILL: when new calls stop placing on the member (etcd's lease expiry, or a
    failed call), and how long the call in flight to it took (bounded by the timeout)."""
    etcd, servers = clusters
    keys = prefix_hashes(range(64 * 16), 16)
    with _client(etcd, "three", 3) as client:
        client.put(keys, np.zeros(BB * 64, np.uint8))
        victim, address = servers[0]
        in_flight: list[float] = []

        def call() -> None:
            start = time.monotonic()
            client.contains(keys)
            in_flight.append(time.monotonic() - start)

        victim.kill()
        killed = time.monotonic()
        caller = threading.Thread(target=call)
        caller.start()
        while address in client.members():
            time.sleep(0.01)
        left = time.monotonic() - killed
        caller.join(60)
    line = (
        f"failover: new calls leave the killed member out {left:.2f} s after SIGKILL; the "
        f"call in flight to it took {in_flight[0]:.2f} s (timeout 10 s)"
    )
    _EXTRA_LINES.append(line)
    print(line)
