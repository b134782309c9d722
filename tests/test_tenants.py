"""Tenants of a real ``kvbridge serve --tenants``, acting as a tenant that wants more than
its share or another tenant's data would: wrong secrets, borrowed names, namespaces outside
its prefixes, writes as a read-only tenant, more sessions to get more room. Each must be
refused and change nothing; every other tenant goes on as before."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from attack import RawStream, abort, ask_room, guess_auth, handle_of, stage
from helpers import keys, payloads
from serve import ServeProcess

from kvbridge.store import (
    BlockNotFound,
    NotPermitted,
    StoreClient,
    TooManyRequests,
    UnknownNamespace,
)
from kvbridge.transfer import AuthenticationError, TransferError
from kvbridge.transfer._events import Error
from kvbridge.transfer._protocol import ErrorCode

BB = 64 << 10
SLOTS = 16
"""Memory slots of each namespace (4 namespaces served)."""

TENANTS = """
[[tenant]]
name = "alpha"
secret = "alpha's secret"
namespaces = ["alpha/", "shared/"]
max_namespaces = 2
max_sessions = 3
max_streams = 6
max_leases = 6

[[tenant]]
name = "beta"
secret_file = "beta.secret"
namespaces = ["beta/", "shared/"]

[[tenant]]
name = "reader"
secret = "reader's secret"
namespaces = ["alpha/"]
access = "read-only"
"""
SECRETS = {"alpha": "alpha's secret", "beta": "beta's secret", "reader": "reader's secret"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    folder = tmp_path_factory.mktemp("tenants")
    (folder / "tenants.toml").write_text(TENANTS)
    (folder / "beta.secret").write_text(SECRETS["beta"] + "\n")
    (folder / "operator.secret").write_text("the operator's secret\n")
    server = ServeProcess(
        *("--tenants", str(folder / "tenants.toml")),
        *("--secret-file", str(folder / "operator.secret")),
        *("--host-capacity", str(4 * SLOTS * BB), "--max-namespaces", "4"),
        *("--lease-ttl", "30", "--handoff-ttl", "0"),
    )
    yield server
    server.kill()


def _client(server: ServeProcess, tenant: str, namespace: str, **kw: object) -> StoreClient:
    secret = kw.pop("secret", SECRETS.get(tenant))
    return StoreClient(
        server.address,
        block_bytes=BB,
        namespace=namespace,
        secret=secret,  # type: ignore[arg-type]
        tenant=tenant,
        timeout=10,
        **kw,  # type: ignore[arg-type]
    )


# -- who it is -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tenant", "secret"),
    [
        ("alpha", SECRETS["beta"]),  # another tenant's secret
        ("beta", SECRETS["alpha"]),
        ("gamma", SECRETS["alpha"]),  # no such tenant
        ("", SECRETS["alpha"]),  # the default principal: not a tenant here
        ("", "the operator's secret"),  # the operator's secret opens the metrics only
        ("alpha", None),
    ],
)
def test_a_tenant_proves_its_own_secret(server: ServeProcess, tenant: str, secret: str) -> None:
    with pytest.raises(AuthenticationError):
        _client(server, tenant, "alpha/m", secret=secret)


def test_an_unknown_tenant_is_refused_as_a_wrong_secret_is(server: ServeProcess) -> None:
    unknown = guess_auth(server.address, principal="gamma")
    wrong = guess_auth(server.address, principal="alpha")
    assert unknown["ok"] is False and wrong["ok"] is False
    assert (unknown["code"], unknown["error"]) == (wrong["code"], wrong["error"])


# -- what it may open ------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["beta/m", "BETA/m", "beta", "", "\x00beta/m", "alpha", " alpha/m", "shared"]
)
def test_a_namespace_outside_the_tenants_prefixes_is_refused(
    server: ServeProcess, name: str
) -> None:
    with pytest.raises(NotPermitted):
        _client(server, "alpha", name)


def test_a_tenant_never_reads_or_clears_another_tenants_blocks(server: ServeProcess) -> None:
    ks = keys(0, 4)
    with _client(server, "beta", "beta/private") as beta:
        beta.put(ks, payloads(ks, BB))
        with _client(server, "alpha", "alpha/own") as alpha:
            listed = [entry["name"] for entry in alpha.server_stats()["namespaces"]]
            assert not any("private" in name for name in listed)
            for handle in range(1, 64):  # guessing the handle of beta's namespace
                reply = alpha.peer.call({"op": "clear", "ns": handle})
                if handle != handle_of(alpha):
                    assert reply.get("kind") == UnknownNamespace.__name__, reply
        assert beta.match_prefix(ks) == 4
        out = np.zeros((4, BB), np.uint8)
        beta.get(ks, out)
        assert (out == payloads(ks, BB)).all()


def test_tenants_given_one_prefix_share_its_namespaces(server: ServeProcess) -> None:
    ks = keys(100, 102)
    with _client(server, "alpha", "shared/cache") as alpha:
        alpha.put(ks, payloads(ks, BB))
    with _client(server, "beta", "shared/cache") as beta:
        out = np.zeros((2, BB), np.uint8)
        beta.get(ks, out)
        assert (out == payloads(ks, BB)).all()


# -- a read-only tenant ----------------------------------------------------------------


def test_a_read_only_tenant_reads_and_never_writes(server: ServeProcess) -> None:
    ks = keys(200, 203)
    with _client(server, "alpha", "alpha/models") as alpha:
        alpha.put(ks, payloads(ks, BB))
        with _client(server, "reader", "alpha/models") as reader:
            out = np.zeros((3, BB), np.uint8)
            reader.get(ks, out)
            assert (out == payloads(ks, BB)).all()
            theirs = keys(300, 302)
            with pytest.raises(NotPermitted):
                reader.put(theirs, payloads(theirs, BB))
            with pytest.raises(NotPermitted):
                reader.remove(ks)
            with pytest.raises(NotPermitted):
                reader.clear()
            with pytest.raises(NotPermitted):
                stage(reader, theirs)
            assert alpha.contains(ks + theirs) == [True] * 3 + [False] * 2
            with pytest.raises(NotPermitted):
                _client(server, "reader", "beta/private")
        with pytest.raises(BlockNotFound):
            alpha.get(keys(300, 301), np.zeros((1, BB), np.uint8))


# -- shares count the tenant, not its sessions -----------------------------------------


def test_more_sessions_give_a_tenant_no_more_slots(server: ServeProcess) -> None:
    request = SLOTS // 4
    first = _client(server, "alpha", "shared/slots")
    second = _client(server, "alpha", "shared/slots")
    try:
        held = [stage(first, keys(400, 400 + request))[0]]  # a quarter of the slots
        held.append(stage(second, keys(500, 500 + request))[0])  # half: the tenant's share
        with pytest.raises(TooManyRequests, match="tenant alpha"):
            stage(second, keys(600, 601))  # a second session of alpha gets nothing more
        with pytest.raises(TooManyRequests, match="tenant alpha"):
            stage(first, keys(600, 601))
        with _client(server, "beta", "shared/slots") as beta:  # beta keeps its share
            ks = keys(700, 700 + SLOTS // 2)
            beta.put(ks, payloads(ks, BB))
            assert beta.match_prefix(ks) == SLOTS // 2
        for client, lease in zip((first, second), held, strict=True):
            abort(client, lease)
    finally:
        first.close()
        second.close()


def test_a_tenants_unfinished_puts_leave_others_their_puts(server: ServeProcess) -> None:
    squatters = [_client(server, "alpha", "shared/puts") for _ in range(2)]
    try:  # two sessions of alpha start puts they never send, for every block twice over
        ask_room(squatters[0], keys(800, 800 + SLOTS), put=1)
        ask_room(squatters[1], keys(900, 900 + SLOTS), put=2)
        with pytest.raises(TooManyRequests, match="puts in progress"):  # memory is bounded
            ask_room(squatters[1], keys(1000, 1001), put=3)
        with _client(server, "beta", "shared/puts") as beta:  # a put of two requests
            ks = keys(1000, 1000 + SLOTS // 2)
            assert beta.put(ks, payloads(ks, BB)) == [True] * len(ks)
            assert beta.match_prefix(ks) == len(ks)
    finally:
        for client in squatters:
            client.close()


def test_more_sessions_give_a_tenant_no_more_namespaces(server: ServeProcess) -> None:
    one = _client(server, "alpha", "alpha/one")
    two = _client(server, "alpha", "alpha/two")
    try:
        with pytest.raises(TooManyRequests, match="namespaces, all in use"):
            _client(server, "alpha", "alpha/three")
        with _client(server, "beta", "beta/other") as beta:  # the server has room for beta
            beta.put(keys(0, 1), payloads(keys(0, 1), BB))
    finally:
        one.close()
        two.close()


def test_a_tenants_sessions_are_bounded_and_others_still_connect(server: ServeProcess) -> None:
    clients = [_client(server, "alpha", "alpha/sessions") for _ in range(3)]
    try:
        with pytest.raises(AuthenticationError, match="sessions"):
            _client(server, "alpha", "alpha/sessions")
        with _client(server, "beta", "beta/sessions") as beta:
            assert beta.match_prefix(keys(0, 1)) == 0
    finally:
        for client in clients:
            client.close()


def test_a_tenants_streams_are_bounded_and_others_still_connect(server: ServeProcess) -> None:
    with _client(server, "alpha", "alpha/streams") as alpha:  # 2 streams of alpha's 6
        extra = [RawStream(alpha, index=10 + n) for n in range(4)]
        try:
            refused = RawStream(alpha, index=20, greeted=False)
            answer = refused.event()
            assert isinstance(answer, Error) and answer.code == ErrorCode.AUTHENTICATION
            refused.close()
            with pytest.raises(TransferError):  # another session of alpha gets no stream
                _client(server, "alpha", "alpha/streams")
            with _client(server, "beta", "beta/streams") as beta:
                beta.put(keys(0, 1), payloads(keys(0, 1), BB))
        finally:
            for stream in extra:
                stream.close()


def test_more_sessions_give_a_tenant_no_more_leases(server: ServeProcess) -> None:
    first = _client(server, "alpha", "alpha/leases")
    second = _client(server, "alpha", "alpha/leases")
    try:
        leases = [stage(first, keys(i, i + 1))[0] for i in range(3)]
        leases += [stage(second, keys(10 + i, 11 + i))[0] for i in range(3)]
        with pytest.raises(TooManyRequests, match="open leases"):
            stage(second, keys(20, 21))
        for lease in leases[:3]:
            abort(first, lease)
        stage(second, keys(20, 21))  # room again
    finally:
        first.close()
        second.close()


@pytest.mark.slow
def test_the_tenants_file_is_checked_at_start(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    for text, why in [
        ('[[tenant]]\nname = "a"\n', "secret"),
        ('[[tenant]]\nname = "a b"\nsecret = "s"\n', "principal"),
        ('[[tenant]]\nname = "a"\nsecret = "s"\n[[tenant]]\nname = "a"\nsecret = "t"\n', "once"),
        ('[[tenant]]\nname = "a"\nsecret = "s"\nslots = 1.5\n', "slots"),
        ('[[tenant]]\nname = "a"\nsecret = "s"\naccess = "admin"\n', "access"),
        ('[[tenant]]\nname = "a"\nsecret = "s"\ncolour = "red"\n', "colour"),
        ("name = 'a'\n", "tenant"),
    ]:
        bad.write_text(text)
        with pytest.raises(AssertionError, match=why):
            ServeProcess("--tenants", str(bad))


# -- one tenant's churn never pushes out another's namespaces -----------------------------


def test_a_read_only_tenant_creates_no_namespace(server: ServeProcess) -> None:
    for n in range(3):
        with pytest.raises(NotPermitted, match="read-only"):
            _client(server, "reader", f"alpha/probe{n}")


@pytest.fixture(scope="module")
def disk_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, Path]]:
    folder = tmp_path_factory.mktemp("churn")
    (folder / "tenants.toml").write_text(TENANTS)
    (folder / "beta.secret").write_text(SECRETS["beta"] + "\n")
    server = ServeProcess(
        *("--tenants", str(folder / "tenants.toml")),
        *("--host-capacity", str(4 * SLOTS * BB), "--max-namespaces", "4"),
        *("--disk-path", str(folder / "disk"), "--disk-capacity", str(64 << 20)),
        *("--lease-ttl", "30", "--handoff-ttl", "0"),
    )
    yield server, folder / "disk"
    server.kill()


@pytest.mark.slow
def test_one_tenants_churn_keeps_anothers_idle_namespaces(
    disk_server: tuple[ServeProcess, Path],
) -> None:
    server, disk = disk_server
    ks = keys(0, 8)
    with _client(server, "beta", "beta/kept") as beta:
        beta.put(ks, payloads(ks, BB))
    theirs = {p.name for p in disk.iterdir()}  # beta's directory, its namespace now idle
    for n in range(12):  # alpha opens and closes new namespaces, far past the server's 4
        with _client(server, "alpha", f"alpha/churn{n}") as alpha:
            alpha.put(keys(n, n + 1), payloads(keys(n, n + 1), BB))
    assert theirs <= {p.name for p in disk.iterdir()}  # beta's directory is still there
    with _client(server, "beta", "beta/kept") as beta:  # and its namespace still in memory
        assert beta.match_prefix(ks) == 8
        out = np.zeros((8, BB), np.uint8)
        beta.get(ks, out)
        assert (out == payloads(ks, BB)).all()


@pytest.mark.slow
def test_namespace_churn_writes_a_few_log_lines(tmp_path: Path) -> None:
    (tmp_path / "tenants.toml").write_text(TENANTS)
    (tmp_path / "beta.secret").write_text(SECRETS["beta"] + "\n")
    server = ServeProcess(
        *("--tenants", str(tmp_path / "tenants.toml")),
        *("--host-capacity", str(4 * SLOTS * BB), "--max-namespaces", "4"),
    )
    try:
        for n in range(40):
            with _client(server, "alpha", f"alpha/churn{n}"):
                pass
    finally:
        log = server.stop_and_read_log()
    lines = [line for line in log.splitlines() if "opened" in line or "reclaimed" in line]
    assert 2 <= len(lines) <= 6, lines


def test_a_tenants_handoff_holds_count_against_its_share(tmp_path: Path) -> None:
    (tmp_path / "tenants.toml").write_text(TENANTS)
    (tmp_path / "beta.secret").write_text(SECRETS["beta"] + "\n")
    server = ServeProcess(
        *("--tenants", str(tmp_path / "tenants.toml")),
        *("--host-capacity", str(4 * SLOTS * BB), "--max-namespaces", "4"),
        *("--lease-ttl", "60", "--handoff-ttl", "30"),
    )
    try:
        with _client(server, "alpha", "shared/holds") as alpha:
            pushed = keys(0, SLOTS // 2)
            alpha.put(pushed, payloads(pushed, BB))  # held for their first read
            leases = []
            with pytest.raises(TooManyRequests, match="tenant alpha"):
                for n in range(SLOTS // alpha.request_keys):  # and stage what it can
                    part = keys(100 + 4 * n, 104 + 4 * n)
                    leases.append(stage(alpha, part)[0])
            with _client(server, "beta", "shared/holds") as beta:
                ks = keys(200, 200 + SLOTS // 2)  # beta still has its half
                assert beta.put(ks, payloads(ks, BB)) == [True] * len(ks)
            for lease in leases:
                abort(alpha, lease)
    finally:
        server.kill()
