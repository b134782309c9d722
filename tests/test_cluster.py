"""A cluster of real ``kvbridge serve`` processes on a real etcd: keys spread evenly and read
back byte for byte; a SIGKILLed member turns into misses (its replicated prefix blocks
still hit), never into errors or hangs; a joining member takes about a quarter of the keys
and reads still hit; a member restarted on the same disk serves its blocks again; etcd
stopped leaves clients working on the members they last saw."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from etcd_support import needs_etcd, until
from helpers import payloads
from serve import ServeProcess

from kvbridge.store import BlockNotFound, ClusterClient, StoreClient, StoreClosed, prefix_hashes
from kvbridge.store.cluster._rendezvous import Rendezvous
from kvbridge.tools._etcd_process import EtcdProcess

pytestmark = needs_etcd

BB = 4096
NS = "cluster-test"
TIMEOUT = 3.0


def _server(etcd: EtcdProcess, *extra: str) -> ServeProcess:
    return ServeProcess(
        *("--cluster", etcd.url, "--cluster-name", "t", "--host-capacity", "32MiB"),
        *("--handoff-ttl", "0", "--max-namespaces", "1"),
        *extra,
    )


def _client(etcd: EtcdProcess, replicas: int = 2, replicated_blocks: int = 4) -> ClusterClient:
    return ClusterClient(
        etcd.url,
        block_bytes=BB,
        namespace=NS,
        cluster="t",
        timeout=TIMEOUT,
        replicas=replicas,
        replicated_blocks=replicated_blocks,
    )


def _chains(count: int, blocks: int) -> list[list[bytes]]:
    """``count`` prompts of ``blocks`` 16-token blocks, each its own prefix."""
    return [
        list(prefix_hashes(range(c * 10**6, c * 10**6 + blocks * 16), 16)) for c in range(count)
    ]


@pytest.fixture
def cluster() -> Iterator[tuple[EtcdProcess, list[ServeProcess]]]:
    with EtcdProcess() as etcd:
        servers = [_server(etcd) for _ in range(3)]
        try:
            yield etcd, servers
        finally:
            for server in servers:
                server.kill()


def _held(server: ServeProcess) -> int:
    with StoreClient(server.address, block_bytes=BB, namespace=NS) as client:
        return sum(t.blocks for t in client.stats().tiers)


@pytest.mark.slow
def test_keys_spread_evenly_and_read_back(cluster: tuple[EtcdProcess, list[ServeProcess]]) -> None:
    etcd, servers = cluster
    with _client(etcd, replicated_blocks=0) as client:
        until(lambda: len(client.members()) == 3)
        chains = _chains(30, 100)  # 3,000 blocks from 30 prefixes
        for chain in chains:
            assert all(client.put(chain, payloads(chain, BB)))
        out = np.zeros((100, BB), np.uint8)
        for chain in chains:
            client.get(chain, out)
            assert (out == payloads(chain, BB)).all()
            assert client.match_prefix(chain) == 100
    counts = [_held(s) for s in servers]
    assert sum(counts) == 3000
    assert all(abs(c - 1000) <= 150 for c in counts), counts
    shown = _kvbridge("stats", etcd.url, "--cluster-name", "t")
    assert shown.returncode == 0, shown.stderr
    assert "3 member(s)" in shown.stdout and "3000 blocks" in shown.stdout
    assert all(f"member {s.address}" in shown.stdout for s in servers)


def _kvbridge(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbridge", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_stats_of_an_unreachable_cluster_is_one_line() -> None:
    shown = _kvbridge("stats", "etcd://127.0.0.1:1")
    assert shown.returncode == 1 and "Traceback" not in shown.stderr
    assert shown.stderr.startswith("kvbridge stats: cannot read the cluster from etcd")


@pytest.mark.slow
def test_a_killed_member_is_misses_not_errors_and_its_replicas_still_hit(
    cluster: tuple[EtcdProcess, list[ServeProcess]],
) -> None:
    etcd, servers = cluster
    with _client(etcd, replicas=2, replicated_blocks=4) as client:
        until(lambda: len(client.members()) == 3)
        chains = _chains(20, 12)
        for chain in chains:
            client.put(chain, payloads(chain, BB))
        slowest = [0.0]
        wrong: list[bytes] = []
        passes = [0]  # the reader's rounds over every chain
        stop = threading.Event()

        def reader() -> None:
            out = np.zeros((12, BB), np.uint8)
            while not stop.is_set():
                passes[0] += 1
                for chain in chains:
                    start = time.monotonic()
                    try:
                        client.get(chain, out)
                        if not (out == payloads(chain, BB)).all():
                            wrong.append(chain[0])
                    except BlockNotFound:
                        pass  # the dead member's blocks are misses
                    slowest[0] = max(slowest[0], time.monotonic() - start)

        written: list[list[bytes]] = []

        def writer() -> None:
            for chain in _chains(400, 12)[200:]:  # new prompts, pushed while a member dies
                if stop.is_set():
                    return
                start = time.monotonic()
                client.put(chain, payloads(chain, BB))
                written.append(chain)
                slowest[0] = max(slowest[0], time.monotonic() - start)

        threads = [threading.Thread(target=reader), threading.Thread(target=writer)]
        for thread in threads:
            thread.start()
        until(lambda: passes[0] >= 2 and len(written) >= 1, "reads and writes under way")
        victim = servers[0]
        victim.kill()  # SIGKILL: no deregistration
        until(lambda: victim.address not in client.members(), "the dead member left out", 30)
        after = passes[0]
        until(lambda: passes[0] >= after + 2, "two rounds of reads without it", 60)
        stop.set()
        for thread in threads:
            thread.join(60)
            assert not thread.is_alive()
        assert not wrong
        assert slowest[0] < TIMEOUT + 2  # one timeout on the dead member at most, then on
        print(f"slowest call while a member died: {slowest[0]:.2f} s (timeout {TIMEOUT} s)")
        out12 = np.zeros((12, BB), np.uint8)
        for chain in written:  # every pushed prompt reads back whole, or is a miss
            try:
                client.get(chain, out12)
                assert (out12 == payloads(chain, BB)).all()
            except BlockNotFound:
                pass
        assert victim.address not in client.members()
        out = np.zeros((4, BB), np.uint8)
        for chain in chains:  # every replicated head block still hits
            client.get(chain[:4], out)
            assert (out == payloads(chain[:4], BB)).all()
        survivors = Rendezvous([s.address for s in servers])
        tails = [k for chain in chains for k in chain[4:]]
        kept = [k for k in tails if survivors.owner_names(k)[0] != victim.address]
        present = client.contains(kept, chain_start=4)
        assert all(present)  # the survivors' blocks hit


@pytest.mark.slow
def test_a_fourth_member_takes_about_a_quarter_and_reads_still_hit(
    cluster: tuple[EtcdProcess, list[ServeProcess]],
) -> None:
    etcd, servers = cluster
    with _client(etcd, replicated_blocks=0) as client:
        until(lambda: len(client.members()) == 3)
        chains = _chains(20, 50)
        for chain in chains:
            client.put(chain, payloads(chain, BB))
        before = Rendezvous(client.members())
        servers.append(_server(etcd))
        until(lambda: len(client.members()) == 4)
        after = Rendezvous(client.members())
        keys = [k for chain in chains for k in chain]
        moved = sum(before.owner_names(k) != after.owner_names(k) for k in keys)
        assert 0.15 <= moved / len(keys) <= 0.33, moved / len(keys)
        out = np.zeros((50, BB), np.uint8)
        for chain in chains:  # the new owner is empty: the previous one still answers
            client.get(chain, out)
            assert (out == payloads(chain, BB)).all()


@pytest.mark.slow
def test_a_member_restarted_on_its_disk_serves_its_blocks_again(tmp_path: Path) -> None:
    with EtcdProcess() as etcd:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = str(sock.getsockname()[1])
        disk = ("--port", port, "--disk-path", str(tmp_path), "--disk-capacity", "64MiB")
        servers = [_server(etcd, *disk), _server(etcd), _server(etcd)]
        try:
            with _client(etcd, replicated_blocks=0) as client:
                until(lambda: len(client.members()) == 3)
                chains = _chains(10, 30)
                for chain in chains:
                    client.put(chain, payloads(chain, BB))
                servers[0].kill()
                until(lambda: len(client.members()) == 2, timeout=20)
                servers[0] = _server(etcd, *disk)
                until(lambda: len(client.members()) == 3, timeout=20)
                out = np.zeros((30, BB), np.uint8)
                for chain in chains:
                    client.get(chain, out)
                    assert (out == payloads(chain, BB)).all()
        finally:
            for server in servers:
                server.kill()


@pytest.mark.slow
def test_etcd_stopped_leaves_clients_on_the_members_they_saw(
    cluster: tuple[EtcdProcess, list[ServeProcess]],
) -> None:
    etcd, servers = cluster
    with _client(etcd) as client:
        until(lambda: len(client.members()) == 3)
        chain = _chains(1, 20)[0]
        etcd.stop()
        until(lambda: client.membership_stale, "the client saw etcd go")
        client.put(chain, payloads(chain, BB))
        out = np.zeros((20, BB), np.uint8)
        client.get(chain, out)
        assert (out == payloads(chain, BB)).all()
        assert len(client.members()) == 3
        etcd.start()
        until(lambda: not client.membership_stale and len(client.members()) == 3)
    for server in servers:
        assert server.proc.poll() is None  # the servers kept serving
    servers[0].stop(signal.SIGTERM)


def test_an_unreachable_etcd_is_a_connection_error() -> None:
    with pytest.raises(ConnectionError, match="cannot read the cluster from etcd"):
        ClusterClient("etcd://127.0.0.1:1", block_bytes=BB)
    with pytest.raises(ValueError, match="not etcd://"):
        ClusterClient("http://127.0.0.1:1", block_bytes=BB)


@pytest.mark.slow
def test_a_member_that_refuses_is_skipped_and_nothing_is_stored_late() -> None:
    """One member has no namespace slot left (another tenant holds its only one): it
    refuses every call. Puts go to the next member and return normally; what the caller
    writes into its buffer after put returned is never stored (a part still running after
    a refusal used to read it); reads find every block."""
    with EtcdProcess() as etcd:
        full = _server(etcd)  # --max-namespaces 1
        other = _server(etcd)
        try:
            with (
                StoreClient(full.address, block_bytes=BB, namespace="tenant-a"),
                _client(etcd, replicated_blocks=0) as client,
            ):
                until(lambda: len(client.members()) == 2)
                chains = _chains(8, 16)
                for chain in chains:
                    buffer = payloads(chain, BB)
                    client.put(chain, buffer)
                    buffer[:] = 0xEE  # reused by the caller at once
                out = np.zeros((16, BB), np.uint8)
                for chain in chains:
                    client.get(chain, out)
                    assert (out == payloads(chain, BB)).all()
        finally:
            full.kill()
            other.kill()


@pytest.mark.slow
def test_closing_while_a_call_runs_is_a_typed_error(
    cluster: tuple[EtcdProcess, list[ServeProcess]],
) -> None:
    etcd, _ = cluster
    client = _client(etcd)
    until(lambda: len(client.members()) == 3)
    client.close()
    chain = _chains(1, 4)[0]
    with pytest.raises(StoreClosed):
        client.put(chain, payloads(chain, BB))
    assert not [t for t in threading.enumerate() if t.name.startswith("kvbridge-cluster")]
