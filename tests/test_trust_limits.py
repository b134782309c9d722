"""The cache server's trust boundary, part two: fair sharing, faults, operations, and the
defects an independent attack found (each test failed on the code before its fix).

Part one (``test_trust.py``) attacks the bytes: late and foreign writes, foreign reads,
stolen session material. Here: limits one client cannot pass, a full disk, a restart, the
server's log and metrics, and the attack's findings. Every test runs over TCP and over UCX.
"""

from __future__ import annotations

import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from attack import RawStream, descriptors, guess_auth, raw, region_key, stage
from helpers import keys, payloads, until
from serve import (
    BLOCK,
    SLOTS,
    TRANSPORTS,
    ServeProcess,
    client_of,
    handle,
    namespaces,
    no_tenants_over,
    small_server,
    two_sided,
)

from kvbridge.store import BadRequest, StoreClient, StoreFull, TooManyRequests
from kvbridge.store._wire import InternalError
from kvbridge.transfer import AuthenticationError
from kvbridge.transfer._events import Data

BB = BLOCK


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def server(transport: str) -> Iterator[ServeProcess]:
    s = small_server(transport)
    yield s
    s.kill()


# -- fair sharing -----------------------------------------------------------------------


@pytest.mark.slow
def test_limits_per_request_per_session_and_on_block_size(
    server: ServeProcess, transport: str
) -> None:
    with client_of(server, transports=transport) as client:
        assert client.request_keys == SLOTS // 4
        with pytest.raises(TooManyRequests, match="in one request"):
            stage(client, keys(0, SLOTS // 4 + 1))
        leases = [stage(client, keys(0, 2))[0], stage(client, keys(2, 4))[0]]
        with pytest.raises(TooManyRequests, match="share"):
            stage(client, keys(4, 5))
        for lease in leases:
            raw(client).op("abort", lease=lease)
        whole = keys(20, 20 + SLOTS)  # the whole namespace, in requests within the limits
        client.put(whole, payloads(whole, BB))
        assert client.match_prefix(whole) == SLOTS
    for tiny in (1, 4095):
        with pytest.raises(BadRequest, match="block_bytes"):
            StoreClient(server.address, block_bytes=tiny, namespace="tiny", transports=transport)


@pytest.mark.slow
def test_namespaces_per_session_are_capped_and_idle_ones_reclaimed(transport: str) -> None:
    server = ServeProcess(
        *("--host-capacity", str(64 * BB), "--max-namespaces", "2", "--transports", transport)
    )
    try:
        first = client_of(server, "a", transport)
        second = client_of(server, "b", transport)
        with pytest.raises(StoreFull, match="namespaces"):
            client_of(server, "c", transport)  # both in use by live sessions
        first.close()
        thirds: list[StoreClient] = []

        def opens_c() -> bool:  # a refused open changes nothing: asking again is harmless
            try:
                thirds.append(client_of(server, "c", transport))
            except StoreFull:
                return False
            return True

        until(opens_c, "first's session ended with its streams: 'a' is idle and makes way")
        with thirds[0] as third:
            third.put(keys(0, 1), payloads(keys(0, 1), BB))

        def opens(name: str) -> bool:
            body = {"op": "open", "namespace": name.encode(), "block_bytes": BB}
            return "error" not in second.peer.call(body)

        # third's goodbye may lose its race with a loaded machine: then its streams' end
        # ends the session a moment later
        until(lambda: opens("n0"), "third's session ended: 'c' is idle and makes way")
        assert not opens("n1") and not opens("n2")  # the table is full again
        second.close()
    finally:
        server.kill()


@pytest.mark.slow
def test_one_session_opens_at_most_eight_namespaces(transport: str) -> None:
    server = ServeProcess(
        *("--host-capacity", str(64 * BB), "--max-namespaces", "12", "--transports", transport)
    )
    try:
        with client_of(server, "n0", transport) as client:
            for i in range(1, 8):
                reply = client.peer.call(
                    {"op": "open", "namespace": f"n{i}".encode(), "block_bytes": BB}
                )
                assert "error" not in reply
            reply = client.peer.call({"op": "open", "namespace": b"n8", "block_bytes": BB})
            assert reply["kind"] == "TooManyRequests"
    finally:
        server.kill()


# -- in-process: what needs a hand inside the server ----------------------------------


def test_an_internal_error_is_its_own_kind_and_logged(
    caplog: pytest.LogCaptureFixture, transport: str
) -> None:
    from kvbridge.store import CacheServer, ServerConfig  # noqa: PLC0415

    secret = "s3cr3t-never-logged"
    config = ServerConfig(
        port=0, host_capacity=16 * BB, secret=secret.encode(), transports=(transport,)
    )
    with caplog.at_level("DEBUG", logger="kvbridge"), CacheServer(config) as srv:
        with pytest.raises(AuthenticationError):
            StoreClient(
                srv.address, block_bytes=BB, namespace="m", secret="wrong", transports=transport
            )
        refused = guess_auth(srv.address)
        assert refused["ok"] is False and refused["code"] == 2
        with StoreClient(
            srv.address, block_bytes=BB, namespace="m", secret=secret, transports=transport
        ) as client:
            ns = namespaces(srv)[0]

            def broken(keys: object) -> int:
                raise RuntimeError("a bug")

            ns.store.match_prefix = broken  # type: ignore[method-assign]
            with pytest.raises(InternalError):
                client.match_prefix(keys(0, 1))
            assert client.contains(keys(0, 1)) == [False]  # the server goes on
    text = caplog.text
    assert "authentication refused" in text
    assert any(r.exc_info and "a bug" in str(r.exc_info[1]) for r in caplog.records)
    assert "serving on" in text and "secret=set" in text
    assert secret not in text


def test_metrics_need_the_token_when_the_server_has_a_secret(transport: str) -> None:
    import urllib.error  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    from kvbridge.store import CacheServer, ServerConfig  # noqa: PLC0415
    from kvbridge.store.server import metrics_token  # noqa: PLC0415

    secret = b"metrics-secret"
    config = ServerConfig(
        port=0, host_capacity=16 * BB, metrics_port=0, secret=secret, transports=(transport,)
    )
    with CacheServer(config) as srv:
        with StoreClient(
            srv.address, block_bytes=BB, namespace="tenant-x", secret=secret, transports=transport
        ):
            pass
        url = f"http://127.0.0.1:{srv.metrics_port}/metrics"
        for header in (None, "Bearer wrong", f"Bearer {secret.decode()}"):
            request = urllib.request.Request(url)
            if header:
                request.add_header("Authorization", header)
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=5)
            assert refused.value.code == 401
        request = urllib.request.Request(url)
        request.add_header("Authorization", f"Bearer {metrics_token(secret)}")
        with urllib.request.urlopen(request, timeout=5) as answer:
            text = answer.read().decode()
        assert "kvbridge_hits" in text and "tenant-x" in text  # the operator sees names


@pytest.mark.slow
def test_a_client_reconnects_after_the_server_restarts(tmp_path: Path, transport: str) -> None:
    """The old session died with the old server: the client authenticates again on its next
    request, and reads what the restarted server kept on disk."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = (
        *("--host-capacity", "4MiB", "--disk-path", str(tmp_path), "--disk-capacity", "16MiB"),
        *("--transports", transport),
    )
    first = ServeProcess("--port", str(port), *args)
    try:
        client = StoreClient(
            f"127.0.0.1:{port}", block_bytes=BB, namespace="m", transports=transport
        )
        ks = keys(0, 4)
        client.put(ks, payloads(ks, BB))
    finally:
        first.kill()
    second = ServeProcess("--port", str(port), *args)
    try:
        out = np.zeros((4, BB), np.uint8)
        client.get(ks, out)
        np.testing.assert_array_equal(out, payloads(ks, BB))
        client.close()
    finally:
        second.kill()


@pytest.mark.slow
def test_a_full_disk_is_store_full_for_that_put_and_the_server_lives(
    tmp_path: Path, transport: str
) -> None:
    """A server whose disk tier sits on a 2 MiB file system (and is told it has 64 MiB):
    puts past the room fail with StoreFull, nothing half-visible, the server stays up, and
    what was committed before reads back."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a 2 MiB tmpfs (needs root): {done.stderr.strip()}")
    try:
        server = ServeProcess(
            *("--host-capacity", "8MiB", "--disk-path", str(mount), "--disk-capacity", "64MiB"),
            *("--transports", transport),
        )
        try:
            with client_of(server, transports=transport) as client:
                first = keys(0, 8)  # 512 KiB: fits
                client.put(first, payloads(first, BB))
                big = keys(100, 140)  # 2.5 MiB more: cannot fit
                with pytest.raises(StoreFull):
                    client.put(big, payloads(big, BB))
                assert server.proc.poll() is None
                out = np.zeros((8, BB), np.uint8)
                client.get(first, out)
                np.testing.assert_array_equal(out, payloads(first, BB))
                for key in big:  # a block the client was told failed is either absent or whole
                    if client.contains([key])[0]:
                        one = np.zeros((1, BB), np.uint8)
                        client.get([key], one)
                        np.testing.assert_array_equal(one, payloads([key], BB))
        finally:
            server.kill()
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_blocks_larger_than_a_slice_move_through_the_guard(transport: str) -> None:
    """A 4 MiB block travels as four 1 MiB slices (ops) into one slot: a request of as many
    blocks as a request may cover is still admitted whole."""
    from kvbridge.store import CacheServer, ServerConfig  # noqa: PLC0415

    big = 4 << 20
    config = ServerConfig(port=0, host_capacity=16 * big, max_namespaces=1, transports=(transport,))
    with (
        CacheServer(config) as srv,
        StoreClient(srv.address, block_bytes=big, namespace="big", transports=transport) as client,
    ):
        ks = keys(0, client.request_keys)
        client.put(ks, payloads(ks, big))
        out = np.zeros((len(ks), big), np.uint8)
        client.get(ks, out)
        np.testing.assert_array_equal(out, payloads(ks, big))


@pytest.mark.slow
def test_a_namespace_that_is_not_bytes_or_str_is_refused_everywhere(
    server: ServeProcess, transport: str
) -> None:
    """bytes(5) is five zero bytes: a silent wrong namespace, refused by every entry."""
    from kvbridge.store import InvalidNamespace, TieredStore  # noqa: PLC0415

    for wrong in (5, 2.5, None, ["m"]):
        with pytest.raises(InvalidNamespace):
            StoreClient(
                server.address,
                block_bytes=BB,
                namespace=wrong,  # type: ignore[arg-type]
                transports=transport,
            )
        with pytest.raises(InvalidNamespace):
            TieredStore(BB, host_capacity=BB, namespace=wrong)  # type: ignore[arg-type]


@pytest.mark.slow
def test_kvbridge_serve_logs_its_events_on_stderr_and_never_the_secret(
    tmp_path: Path, transport: str
) -> None:
    secret = "correct horse battery staple"
    (tmp_path / "secret").write_text(secret)
    server = ServeProcess(
        *("--host-capacity", "16MiB", "--secret-file", str(tmp_path / "secret")),
        *("--transports", transport),
    )
    try:
        assert guess_auth(server.address)["ok"] is False
        client = StoreClient(
            server.address, block_bytes=BB, namespace="m", secret=secret, transports=transport
        )
        with client, pytest.raises(TooManyRequests):  # one request may not cover 64 blocks
            raw(client).op("stage", keys=keys(0, 64))
    finally:
        server.proc.send_signal(signal.SIGTERM)
        _, err = server.proc.communicate(timeout=30)
    lines = err.splitlines()
    assert any("serving on" in line and "secret=set" in line for line in lines)
    assert any("authentication refused" in line for line in lines)
    assert any("refused stage" in line and "TooManyRequests" in line for line in lines)
    assert secret not in err and "Traceback" not in err


# -- found by an independent attack (each failed before its fix) ------------------------


def test_a_refused_open_reclaims_nothing(transport: str) -> None:
    """An open that must fail (a block larger than a namespace's share) used to close the
    least recently used idle namespace first, losing its blocks. (In this process: the test
    waits for tenant-a's namespace to be idle, reclaimable, before the open.)"""
    from kvbridge.store import CacheServer, ServerConfig  # noqa: PLC0415

    config = ServerConfig(
        port=0, host_capacity=4 << 20, max_namespaces=2, handoff_ttl=0, transports=(transport,)
    )
    with CacheServer(config) as server:
        ks = keys(0, 4)
        with client_of(server, "tenant-a", transport) as tenant:
            tenant.put(ks, payloads(ks, BB))
        (ns,) = namespaces(server)

        def idle() -> bool:
            with ns.lock:
                return ns.idle

        until(idle, "tenant-a's session ended: its namespace is idle")
        with client_of(server, "tenant-b", transport):
            with pytest.raises(StoreFull, match="hold no block"):
                StoreClient(
                    server.address, block_bytes=1 << 30, namespace="huge", transports=transport
                )
            with client_of(server, "tenant-a", transport) as tenant:
                assert tenant.contains(ks) == [True] * 4


def test_a_refused_remove_keeps_the_handoff_holds(transport: str) -> None:
    """remove([pushed, pinned]) is refused (BlockPinned) and must change nothing: the
    pushed block keeps the hold that keeps it for its first reader."""
    from kvbridge.store import BlockPinned, CacheServer, ServerConfig  # noqa: PLC0415

    config = ServerConfig(
        port=0, host_capacity=32 * BB, max_namespaces=1, handoff_ttl=30, transports=(transport,)
    )
    with (
        CacheServer(config) as srv,
        client_of(srv, "m", transport) as prefill,
        client_of(srv, "m", transport) as reader,
    ):
        pushed, pinned = keys(0, 1), keys(1, 2)
        prefill.put(pushed + pinned, payloads(pushed + pinned, BB))
        raw(reader).op("pin", keys=pinned)
        with pytest.raises(BlockPinned):
            prefill.remove(pushed + pinned)
        ns = namespaces(srv)[0]
        assert pushed[0] in ns.leases.holds  # still held for its first read
        assert ns.store.placement.pins.is_pinned(pushed[0])


@pytest.mark.slow
def test_a_read_stalled_on_a_released_lease_still_counts_against_the_share(
    transport: str,
) -> None:
    """Pin the share, start a read of it that never drains, release the leases, pin again:
    the stalled read still holds its blocks, so it still counts, and the second pin is
    refused. Before, one session could hold every slot this way."""
    two_sided(transport)
    block = 1 << 20
    server = ServeProcess(
        *("--host-capacity", str(32 * block), "--max-namespaces", "2", "--transports", transport)
    )
    try:
        with StoreClient(
            server.address, block_bytes=block, namespace="m", transports=transport
        ) as client:
            ks = keys(0, 12)
            client.put(ks, payloads(ks, block))
            leases, slots = [], []
            for start in (0, 4):  # the session's share: 8 of 16 slots, 4 per request
                reply = raw(client).op("pin", keys=ks[start : start + 4])
                leases.append(reply["lease"])
                slots += [int(s) for s in reply["slots"]]
            stalled = RawStream(client)
            if stalled.sock is not None:  # over UCX a payload waits for its receive anyway
                stalled.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            key = region_key(client, raw(client).region)
            ops = descriptors(raw(client).region, key, [(s * block, block) for s in slots])
            stalled.start_read(ops)
            assert isinstance(stalled.event(), Data)  # under way; its payload is never read
            for lease in leases:
                raw(client).op("release", lease=lease)
            with pytest.raises(TooManyRequests, match="share"):
                raw(client).op("pin", keys=ks[8:12])
            stalled.close()  # the read ends: its blocks are the session's no longer

            def pinned() -> bool:
                try:
                    raw(client).op("pin", keys=ks[8:12])
                except TooManyRequests:
                    return False
                return True

            until(pinned, "the stalled read ended and gave its blocks back")
    finally:
        server.kill()


def test_a_request_of_an_ended_session_is_refused(transport: str) -> None:
    from kvbridge.store import CacheServer, ServerConfig  # noqa: PLC0415
    from kvbridge.transfer import Caller  # noqa: PLC0415

    config = ServerConfig(port=0, host_capacity=16 * BB, transports=(transport,))
    with CacheServer(config) as srv:
        reply = handle(srv, Caller(session=12345, peer="gone"), {"op": "stats"})
        assert reply["kind"] == "BadRequest" and "ended" in reply["message"]


# -- the lease ledger (attack on 20883bf) ------------------------------------------------

QUIET_TENANT = """
[[tenant]]
name = "t"
secret = "t's secret"
namespaces = ["t/"]
max_leases = 2
"""


def test_expired_leases_of_a_quiet_namespace_stop_counting_against_the_tenant(
    tmp_path: Path, transport: str
) -> None:
    """A session of a tenant takes the tenant's last leases in one namespace and goes
    quiet (alive, sending nothing); nobody else works in that namespace. Once the leases
    are past their deadline they hold nothing (ACCESS.md: a lease ends at ``lease_ttl``),
    so another session of the tenant, in another namespace, may take leases again. Before:
    their count came back only with the next op in the quiet namespace, so the tenant was
    refused everywhere for as long as that namespace stayed quiet."""
    no_tenants_over(transport)
    (tmp_path / "tenants.toml").write_text(QUIET_TENANT)
    server = ServeProcess(
        *("--tenants", str(tmp_path / "tenants.toml"), "--host-capacity", str(32 * BB)),
        *("--max-namespaces", "2", "--lease-ttl", "1", "--handoff-ttl", "0"),
        *("--transports", transport),
    )

    def tenant_client(namespace: str) -> StoreClient:
        return StoreClient(
            server.address,
            block_bytes=BB,
            namespace=namespace,
            secret="t's secret",
            tenant="t",
            transports=transport,
            timeout=10,
        )

    try:
        with tenant_client("t/quiet") as quiet, tenant_client("t/busy") as busy:
            for i in range(2):
                stage(quiet, keys(i, i + 1))
            with pytest.raises(TooManyRequests, match="open leases"):
                stage(busy, keys(10, 11))  # the tenant's bound, while they are open

            def busy_stages() -> bool:  # a refused stage changes nothing: asking is harmless
                try:
                    return bool(stage(busy, keys(10, 11))[0])
                except TooManyRequests:
                    return False

            # within the 1-s TTL and a margin, never after an op in the quiet namespace
            until(busy_stages, "quiet's expired leases stopped counting", timeout=10)
    finally:
        server.kill()
