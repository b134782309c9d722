"""The connector core on a cluster (``server: "etcd://..."``) of real ``kvbridge serve
--cluster`` processes: pages saved by one core load byte for byte in another, directly and
through the staging buffer, with every member holding part of them (counted on the
members); a member killed is misses, not errors, and no call waits out the timeout; an
unreachable etcd, or a cluster with no members yet, is a warning and misses; bad cluster
settings are config errors."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import numpy as np
import pytest
from etcd_support import EtcdProcess, needs_etcd, until
from helpers import free_port
from serve import ServeProcess

from kvbridge.bindings import ConnectorConfig, ConnectorCore, Identity, PagedKV, pages_of
from kvbridge.store import ClusterClient, ConfigError, StoreClient

pytestmark = needs_etcd

PAGE = 4096
LAYERS = 3
CLUSTER = "engines"
TIMEOUT = 20.0
"""Long on purpose: a call that waited it out after a member's death fails the bounds."""


def _identity(extra: str) -> Identity:
    return Identity(
        engine="test",
        model="m",
        dtype="float32",
        layout="cpu/2x64",
        block_tokens=16,
        block_bytes=PAGE * LAYERS,
        shard="tp0/1",
        extra=extra,
    )


def _kv(blocks: int, seed: int) -> tuple[list[np.ndarray], PagedKV]:
    rng = np.random.default_rng(seed)
    layers = [rng.integers(0, 256, (blocks, 2, PAGE // 2), dtype=np.uint8) for _ in range(LAYERS)]
    return layers, PagedKV(tuple(pages_of(layer, f"l{i}") for i, layer in enumerate(layers)), "t")


def _member(etcd: EtcdProcess) -> ServeProcess:
    return ServeProcess(
        *("--cluster", etcd.url, "--cluster-name", CLUSTER, "--host-capacity", "64MiB"),
        *("--handoff-ttl", "0", "--max-namespaces", "8", "--events-port", "0"),
    )


@pytest.fixture
def cluster() -> Iterator[tuple[EtcdProcess, list[ServeProcess]]]:
    with EtcdProcess() as etcd:
        members = [_member(etcd) for _ in range(3)]
        try:
            _listed(etcd, 3)
            yield etcd, members
        finally:
            for member in members:
                member.kill()


def _config(etcd: EtcdProcess, **extra: object) -> ConnectorConfig:
    settings = {"server": etcd.url, "cluster_name": CLUSTER, "timeout": TIMEOUT}
    return ConnectorConfig.from_extra({**settings, **extra})


def _core(config: ConnectorConfig, ident: Identity, kv: PagedKV) -> ConnectorCore:
    core = ConnectorCore(config, ident, connections=2)
    core.attach(kv)
    return core


def _listed(etcd: EtcdProcess, count: int) -> None:
    """Wait until etcd lists ``count`` members (a core made after this places on all)."""
    with ClusterClient(etcd.url, block_bytes=PAGE, cluster=CLUSTER) as watcher:
        until(lambda: len(watcher.members()) == count)


def _pulled(members: list[ServeProcess], ident: Identity, core: ConnectorCore) -> list[int]:
    """Per member, the blocks it holds of the core's namespace."""
    held = []
    for member in members:
        with StoreClient(
            member.address, block_bytes=ident.block_bytes, namespace=core.namespace
        ) as client:
            held.append(sum(t.blocks for t in client.stats().tiers))
    return held


@pytest.mark.slow
@pytest.mark.parametrize("staging", ["auto", "always"])
def test_pages_saved_through_the_cluster_load_byte_for_byte_elsewhere(
    cluster: tuple[EtcdProcess, list[ServeProcess]], staging: str
) -> None:
    etcd, members = cluster
    ident = _identity(f"cluster-{staging}")
    config = _config(etcd, staging=staging, staging_bytes=5 * PAGE * LAYERS)
    _, kv = _kv(blocks=64, seed=1)
    saved = list(range(63, 23, -1))  # 40 blocks, scattered
    with _core(config, ident, kv) as writer:
        ks = writer.keys(list(range(16 * 40)))
        assert writer.save(ks, saved) and writer.lookup(ks) == 40
        held = _pulled(members, ident, writer)
    assert all(h > 0 for h in held) and sum(held) == 40 + 40  # 40 heads: the first 64 twice
    _, fresh = _kv(blocks=64, seed=2)
    with _core(config, ident, fresh) as reader:
        assert reader.lookup(ks) == 40
        hold = reader.pin(ks)
        assert hold is not None
        loaded = list(range(40))
        assert reader.load(ks, loaded)
        reader.unpin(hold)
        assert np.array_equal(fresh.gather(loaded), kv.gather(saved))
        assert reader.stats.totals()["tokens_loaded"] == 40 * 16


@pytest.mark.slow
def test_a_member_killed_is_misses_and_no_call_waits_out_the_timeout(
    cluster: tuple[EtcdProcess, list[ServeProcess]],
) -> None:
    """Past the replicated heads, a killed member's blocks are misses: the lookup stops
    at the first one, the load of all of them fails fast (the engine computes them), a
    load of the ones before it works, and the store is asked on (no pause after a fault)."""
    etcd, members = cluster
    ident = _identity("killed")
    config = _config(etcd)
    _, kv = _kv(blocks=160, seed=3)
    with _core(config, ident, kv) as core:
        ks = core.keys(list(range(16 * 150)))
        assert core.save(ks, list(range(150))) and core.lookup(ks) == 150
        other = core.keys(list(range(10**6, 10**6 + 16 * 8)))  # all heads: two copies
        assert core.save(other, list(range(150, 158)))
        members[1].kill()
        started = time.monotonic()
        hit = core.lookup(ks)
        assert 64 <= hit < 150  # every head has a second copy; a later block was lost
        assert not core.load(ks, list(range(150)))  # fails at once: a miss, not a hang
        assert core.load(ks[:hit], list(range(hit)))
        assert time.monotonic() - started < 5.0  # three calls, none of them a timeout
        assert core.lookup(other) == 8  # asked on: no pause as after a store that is down


def test_a_scheduler_mirrors_every_member_and_a_dead_one_is_not_guessed(
    cluster: tuple[EtcdProcess, list[ServeProcess]],
) -> None:
    """The scheduler side's mirror follows every member's event stream: it lists what a
    writer saved over the three. A killed member's mirror falls out of step: the mirror
    then answers nothing (the cluster is asked) until the membership drops the member,
    and then answers without its blocks."""
    etcd, members = cluster
    ident = _identity("mirror")
    _, kv = _kv(blocks=160, seed=5)
    with (
        _core(_config(etcd), ident, kv) as writer,
        ConnectorCore(_config(etcd), ident, mirror=True) as scheduler,
    ):
        ks = writer.keys(list(range(16 * 150)))
        assert writer.save(ks, list(range(150)))
        until(lambda: scheduler.mirrored(ks) == 150, "the mirror lists every saved block")
        assert scheduler.stats.totals()["lookups_local"] > 0
        members[1].kill()
        until(lambda: scheduler.mirrored(ks) is None, "the dead member's mirror is out of step")
        hit = writer.lookup(ks)  # what the two members left hold, as the cluster says
        until(lambda: scheduler.mirrored(ks) == hit, "the mirror without the dead member")


def test_an_unreachable_etcd_is_a_warning_and_misses(caplog: pytest.LogCaptureFixture) -> None:
    config = ConnectorConfig(server=f"etcd://127.0.0.1:{free_port()}", timeout=2)
    with ConnectorCore(config, _identity("no-etcd")) as core:
        ks = core.keys(list(range(64)))
        assert core.lookup(ks) == 0
        assert core.lookup(ks) == 0  # paused: not asked again
        assert core.stats.totals()["store_faults"] == 1
    assert caplog.text.count("computing instead") == 1


def test_a_cluster_with_no_members_yet_is_a_warning_and_misses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A member that joins later is used: its blocks hit."""
    with EtcdProcess() as etcd, caplog.at_level(logging.WARNING, logger="kvbridge"):
        _, kv = _kv(blocks=8, seed=4)
        with ConnectorCore(_config(etcd), _identity("empty")) as core:
            core.attach(kv)
            ks = core.keys(list(range(16 * 4)))
            assert core.lookup(ks) == 0
            assert core.save(ks, [0, 1, 2, 3])  # nowhere to go: nothing stored, no error
            assert core.lookup(ks) == 0
            member = _member(etcd)
            try:
                until(lambda: core.save(ks, [0, 1, 2, 3]) and core.lookup(ks) == 4)
            finally:
                member.kill()
    assert "has no members yet" in caplog.text


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"server": "etcd://"}, "server"),
        ({"server": "etcd://host"}, "server"),
        ({"server": "etcd://h:1,h:x"}, "server"),
        ({"server": "127.0.0.1:7000", "cluster_name": "c"}, "cluster_name"),
        ({"server": "etcd://h:1", "cluster_name": ""}, "cluster_name"),
    ],
)
def test_bad_cluster_settings_are_config_errors(extra: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ConnectorConfig.from_extra(extra)
