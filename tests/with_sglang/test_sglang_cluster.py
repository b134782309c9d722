"""The backend on a cluster (``server: "etcd://..."``) of three ``kvbridge serve
--cluster`` processes, under SGLang's own controller code: backup and prefetch byte for
byte through both interfaces, pages spread over the members; a member SIGKILLed makes
prefetch return fewer pages (the ones before the first lost one), never raise, and no call
waits out the timeout."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from controller import Controller
from etcd_support import EtcdProcess, needs_etcd, until
from host_pools import MHAPool
from serve import ServeProcess
from test_sglang_backend import backend, names
from test_sglang_controller import PAGES, controller_log, pools, within

from kvbridge.store import ClusterClient, StoreClient

pytestmark = needs_etcd

__all__ = ["controller_log"]  # the fixture, used here by name

TIMEOUT = 10
"""The backend's timeout: a call that waited it out on a dead member fails ``within``."""


@pytest.fixture
def cluster() -> Iterator[tuple[str, list[ServeProcess]]]:
    with EtcdProcess() as etcd:
        members = [
            ServeProcess(*("--cluster", etcd.url, "--host-capacity", "64MiB", "--handoff-ttl", "0"))
            for _ in range(3)
        ]
        try:
            with ClusterClient(etcd.url, block_bytes=4096) as watcher:
                until(lambda: len(watcher.members()) == 3, "the members in etcd")
            yield etcd.url, members
        finally:
            for member in members:
                member.kill()


def _held(member: ServeProcess) -> int:
    """Blocks of every namespace the member holds."""
    with StoreClient(member.address, block_bytes=4096, namespace="observer") as client:
        stats: dict[str, Any] = client.server_stats()
    return sum(ns["tiers"][0]["blocks"] for ns in stats["namespaces"])


def _backed_up(url: str, zero_copy: int) -> tuple[Any, Any, Controller, Controller]:
    """Two pools and a controller of each on the cluster; the writer has backed up
    ``PAGES`` pages of its pool."""
    source, target = pools(lambda: MHAPool(pages=PAGES + 4))
    extra = {"server": url, "interface_v1": zero_copy, "timeout": TIMEOUT}
    writer = Controller(backend(source, extra), source)
    reader = Controller(backend(target, extra), target)
    assert writer.backup(names(PAGES), source.slots(*range(PAGES))) == PAGES
    return source, target, writer, reader


@pytest.mark.parametrize("zero_copy", [1, 0], ids=["zero-copy", "copying"])
def test_backup_and_prefetch_through_three_members_byte_for_byte(
    cluster: tuple[str, list[ServeProcess]],
    controller_log: pytest.LogCaptureFixture,
    zero_copy: int,
) -> None:
    url, members = cluster
    source, target, writer, reader = _backed_up(url, zero_copy)
    keys, order = names(PAGES), list(range(PAGES))
    assert all(_held(member) > 0 for member in members)
    assert reader.storage_backend.batch_exists(keys) == PAGES
    placed = order[::-1]
    assert reader.prefetch(keys, target.slots(*placed)) == PAGES
    ps = source.page_size
    assert all(
        target.page_bytes(dst * ps) == source.page_bytes(src * ps)
        for src, dst in zip(order, placed, strict=True)
    )
    assert not controller_log.records
    for ctl in (writer, reader):
        ctl.storage_backend.close()


@pytest.mark.parametrize("zero_copy", [1, 0], ids=["zero-copy", "copying"])
def test_a_killed_member_makes_prefetch_return_fewer_pages(
    cluster: tuple[str, list[ServeProcess]],
    controller_log: pytest.LogCaptureFixture,
    zero_copy: int,
) -> None:
    url, members = cluster
    source, target, writer, reader = _backed_up(url, zero_copy)
    keys = names(PAGES)
    members[2].kill()
    got = within(TIMEOUT - 1, lambda: reader.prefetch(keys, target.slots(*range(PAGES))))
    assert 0 < got < PAGES  # the pages before the first one the member took
    ps = source.page_size
    assert all(target.page_bytes(i * ps) == source.page_bytes(i * ps) for i in range(got))
    assert all(record.exc_info is None for record in controller_log.records)
    for ctl in (writer, reader):
        ctl.storage_backend.close()
