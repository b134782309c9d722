"""The connector on a cluster (``server: "etcd://..."``) of three ``kvbridge serve
--cluster`` processes under a real vLLM: a fresh instance loads every loadable prompt block
(counted on the members), a member restarted on its disk among them; members SIGKILLed
between two rounds and in the middle of one cost recomputation only, and no round waits
out the connector's timeout."""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from etcd_support import EtcdProcess, needs_etcd, until
from harness import LOADABLE, run_engine, spec, tokens
from serve import ServeProcess

from kvbridge.store import ClusterClient, StoreClient

pytestmark = needs_etcd

TIMEOUT = 10
"""The connector's timeout: a round that waited it out on a dead member would show."""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Cluster:
    """etcd and three members, each on a port and a disk of its own (a restarted member
    comes back as itself)."""

    def __init__(self, etcd: EtcdProcess, root: Path) -> None:
        self.etcd = etcd
        self._ports = [_port() for _ in range(3)]
        self._disks = [root / f"member{i}" for i in range(3)]
        self.members = [self._start(i) for i in range(3)]
        self.wait_for(3)

    def _start(self, i: int) -> ServeProcess:
        return ServeProcess(
            *("--cluster", self.etcd.url, "--port", str(self._ports[i])),
            *("--host-capacity", "64MiB", "--handoff-ttl", "0"),
            *("--disk-path", str(self._disks[i]), "--disk-capacity", "64MiB"),
        )

    def restart(self, i: int) -> None:
        self.members[i].stop(signal.SIGTERM)  # a clean stop spills memory to disk
        self.members[i] = self._start(i)
        self.wait_for(3)

    def wait_for(self, count: int) -> None:
        """Until etcd lists ``count`` members (an engine started after this sees them)."""
        with ClusterClient(self.etcd.url, block_bytes=4096) as watcher:
            until(lambda: len(watcher.members()) == count, "the members in etcd")

    def hits(self) -> list[int]:
        """Per member, the hits its namespaces counted."""
        return [_hits(member) for member in self.members]

    def close(self) -> None:
        for member in self.members:
            member.kill()


def _hits(member: ServeProcess) -> int:
    with StoreClient(member.address, block_bytes=4096, namespace="observer") as client:
        stats: dict[str, Any] = client.server_stats()
    return sum(ns["hits"] for ns in stats["namespaces"])


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[_Cluster]:
    with EtcdProcess() as etcd:
        members = _Cluster(etcd, tmp_path)
        try:
            yield members
        finally:
            members.close()


def test_a_fresh_instance_loads_every_block_also_after_a_member_restarts(
    model: str, baseline: list[list[int]], cluster: _Cluster
) -> None:
    """The first instance saves over the three members; one member is stopped and restarted
    on its disk and port; a fresh instance then loads every loadable block, counted on the
    members, the restarted one among them."""
    connector = {"server": cluster.etcd.url, "timeout": TIMEOUT}
    first = run_engine(spec(model, connector))
    assert tokens(first) == baseline and first["stats"]["tokens_saved"] > 0
    cluster.restart(0)
    second = run_engine(spec(model, connector))
    assert tokens(second) == baseline
    assert second["stats"]["tokens_loaded"] == LOADABLE
    hits = cluster.hits()
    assert sum(hits) * 32 >= LOADABLE  # the members count the same blocks
    assert hits[0] > 0  # the restarted member served its blocks from its disk
    assert sum(1 for h in hits if h) >= 2  # spread over the members, not one


def test_members_killed_between_and_within_rounds_cost_recomputation_only(
    model: str, baseline: list[list[int]], cluster: _Cluster
) -> None:
    run = spec(model, {"server": cluster.etcd.url, "timeout": TIMEOUT}, rounds=4)
    run.update(kill_after_round=0, kill_pid=cluster.members[0].proc.pid)
    run.update(kill_in_round=2, kill_in_pid=cluster.members[1].proc.pid)
    result = run_engine(run, timeout=300)
    for round_ in range(4):
        assert tokens(result, round_) == baseline
    assert max(result["seconds"]) < TIMEOUT  # no call waited out the timeout
    assert result["stats"]["tokens_loaded"] > 0  # the third member still served
