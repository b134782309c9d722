"""The cache server's trust boundary, attacked as a hostile client or a fault would.

Each test runs a real ``kvbridge serve`` process (unless it needs to reach inside a server)
and drives it the way an attacker would: with stolen or replayed session material, frames
sent by hand, late bytes, guessed handles and slots. What must hold: no reader ever gets
bytes that are not the ones committed under the key, no session touches another's slots or
another namespace's blocks, and a fault stays with the request that met it.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgpack
import numpy as np
import pytest
from attack import RawStream, control_request, descriptors, guess_auth, region_key
from helpers import keys, payloads

from kvbridge.store import BadRequest, LeaseExpired, StoreClient, StoreFull, TooManyRequests
from kvbridge.store._wire import InternalError
from kvbridge.tools._serve_cmds import read_listening
from kvbridge.transfer import AuthenticationError, RegionInfo, TransferEngine, TransferError
from kvbridge.transfer._protocol import Ack, Data, Error, ErrorCode

BB = 64 << 10
SLOTS = 8  # per namespace: --host-capacity 16 blocks, 2 namespaces


class _Server:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvbridge",
                "serve",
                *(args if "--port" in args else ("--port", "0", *args)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        try:
            self.address, _ = read_listening(self.proc.stdout)
        except RuntimeError:
            raise AssertionError(self.proc.stderr.read()) from None  # type: ignore[union-attr]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.communicate(timeout=30)


@pytest.fixture
def server() -> Iterator[_Server]:
    s = _Server(
        "--host-capacity",
        str(2 * SLOTS * BB),
        "--max-namespaces",
        "2",
        "--lease-ttl",
        "30",
        "--handoff-ttl",
        "0",
    )
    yield s
    s.kill()


def _client(server: _Server, namespace: str = "m") -> StoreClient:
    return StoreClient(server.address, block_bytes=BB, namespace=namespace)


def _stage(client: StoreClient, ks: Sequence[bytes]) -> tuple[int, list[int]]:
    reply = client._call({"op": "stage", "ns": client._ns, "keys": ks})
    return int(reply["lease"]), [int(s) for s in reply["slots"]]


def _slot_ops(client: StoreClient, slots: list[int], region: int | None = None) -> np.ndarray:
    region = client._region if region is None else region
    return descriptors(region, region_key(client, region), [(s * BB, BB) for s in slots])


# -- wrong bytes ------------------------------------------------------------------------


@pytest.mark.parametrize("ending", ["abort", "session"])
def test_a_late_write_never_lands_in_a_slot_handed_to_someone_else(
    server: _Server, ending: str
) -> None:
    """A write admitted while its lease was open whose bytes arrive after the lease ended
    (aborted; or the writer's session ended while a stream of it still sends): the slots
    stay out of use until the bytes are in, so the victim's blocks never get them."""
    with _client(server) as attacker, _client(server) as victim:
        lease, slots = _stage(attacker, keys(0, 2))
        stream = RawStream(attacker)
        stream.start_write(_slot_ops(attacker, slots))
        stream.send(b"\xaa" * BB)  # half of the payload
        time.sleep(0.3)  # admitted: the server now waits for the other half
        if ending == "abort":
            attacker._call({"op": "abort", "ns": attacker._ns, "lease": lease})
        else:  # the session says goodbye mid-write: its leases end with it
            credentials = attacker.peer._credentials
            assert credentials is not None
            assert control_request(server.address, credentials.sign("bye", b""))["ok"]
        theirs = keys(100, 100 + SLOTS)  # as many blocks as the namespace has slots
        victim.put(theirs, payloads(theirs, BB))
        stream.send(b"\xaa" * BB)  # the late bytes
        assert isinstance(stream.event(), Ack)  # they landed, in the ended lease's slots
        present = [k for k in theirs if victim.contains([k])[0]]
        assert len(present) >= SLOTS - 2  # only the two slots being written were unavailable
        out = np.zeros((len(present), BB), np.uint8)
        victim.get(present, out)
        np.testing.assert_array_equal(out, payloads(present, BB))
        more = keys(200, 202)  # and now the two slots are free again
        victim.put(more, payloads(more, BB))
        assert victim.match_prefix(more) == 2
        stream.close()


def test_a_session_cannot_write_another_sessions_staged_slots(server: _Server) -> None:
    with _client(server) as attacker, _client(server) as victim:
        ks = keys(0, 2)
        lease, slots = _stage(victim, ks)
        own, _ = _stage(attacker, keys(10, 11))  # the attacker holds a lease of its own too
        assert own
        stream = RawStream(attacker)
        stream.start_write(_slot_ops(attacker, slots))
        stream.send(b"\xbb" * 2 * BB)
        answer = stream.event()
        assert isinstance(answer, Error) and answer.code == ErrorCode.ACCESS_DENIED
        with pytest.raises(TransferError) as refused:  # and through the engine's own path
            attacker.peer.write(_engine_ops(attacker, slots)).wait(10)
        assert refused.value.code == ErrorCode.ACCESS_DENIED
        with pytest.raises(LeaseExpired):  # nor commit the victim's lease
            attacker._call({"op": "commit", "ns": attacker._ns, "lease": lease})
        attacker._call({"op": "abort", "ns": attacker._ns, "lease": lease})  # a no-op for it
        own_stream = RawStream(victim)  # the lease is still the victim's: it writes, commits
        own_stream.start_write(_slot_ops(victim, slots))
        own_stream.send(payloads(ks, BB).tobytes())
        assert isinstance(own_stream.event(), Ack)
        assert victim._call({"op": "commit", "ns": victim._ns, "lease": lease})["stored"] == 2
        own_stream.close()
        out = np.zeros((2, BB), np.uint8)
        victim.get(ks, out)
        np.testing.assert_array_equal(out, payloads(ks, BB))
        stream.close()


def _engine_ops(client: StoreClient, slots: list[int]) -> np.ndarray:
    from kvbridge.transfer import OP_DTYPE  # noqa: PLC0415

    source = client.engine.register(np.full(len(slots) * BB, 0xCC, np.uint8), access="none")
    ops = np.zeros(len(slots), dtype=OP_DTYPE)
    ops["local_region"], ops["local_offset"] = source.id, np.arange(len(slots)) * BB
    ops["remote_region"], ops["remote_offset"] = client._region, np.asarray(slots) * BB
    ops["length"] = BB
    return ops


# -- reads ------------------------------------------------------------------------------


def test_reads_only_from_slots_pinned_for_the_reading_session(server: _Server) -> None:
    """Another namespace's region (keys from the metadata every session gets), one's own
    namespace unpinned, another session's pins: all refused. One's own pin: read."""
    with _client(server, "tenant-a") as a, _client(server, "tenant-b") as b:
        ks = keys(0, 2)
        a.put(ks, payloads(ks, BB))
        pinned = a._call({"op": "pin", "ns": a._ns, "keys": ks})
        slots = [int(s) for s in pinned["slots"]]
        thief = RawStream(b)
        answer, _ = thief.read(_slot_ops(b, slots, region=a._region))  # tenant-a's memory
        assert isinstance(answer, Error) and answer.code == ErrorCode.ACCESS_DENIED
        with _client(server, "tenant-a") as neighbour:  # same namespace, its own session
            stream = RawStream(neighbour)
            answer, _ = stream.read(_slot_ops(neighbour, slots))  # pinned by a, not by it
            assert isinstance(answer, Error) and answer.code == ErrorCode.ACCESS_DENIED
            stream.close()
        own = RawStream(a)
        answer, payload = own.read(_slot_ops(a, slots))
        assert isinstance(answer, Data)
        assert payload == payloads(ks, BB).tobytes()
        a._call({"op": "release", "ns": a._ns, "lease": pinned["lease"]})
        answer, _ = own.read(_slot_ops(a, slots))  # released: no more reads
        assert isinstance(answer, Error)
        thief.close()
        own.close()


def test_a_namespace_handle_works_only_for_a_session_that_opened_it(server: _Server) -> None:
    with _client(server, "tenant-a") as a, _client(server, "tenant-b") as b:
        a.put(keys(0, 1), payloads(keys(0, 1), BB))
        for op in ("match", "contains", "remove"):
            with pytest.raises(LookupError, match="open it first"):
                b._call({"op": op, "ns": a._ns, "keys": keys(0, 1)})
        assert a.contains(keys(0, 1)) == [True]
        stats = b.server_stats()["namespaces"]
        assert "tenant-a" not in str(stats) and any("tenant-b" in n["name"] for n in stats)


# -- sessions ---------------------------------------------------------------------------


def test_a_session_id_seen_on_the_wire_is_worth_nothing(server: _Server) -> None:
    """The session id travels in clear; requests are signed with a key that never does.
    Forged, replayed and after-disconnect requests are all refused with a code."""
    victim = _client(server)
    credentials = victim.peer._credentials
    assert credentials is not None
    body = b"\x81\xa2op\xa5stats"  # {"op": "stats"}
    forged = {"op": "call", "session": credentials.id, "seq": 10**6, "body": body, "mac": bytes(32)}
    answer = control_request(server.address, forged)
    assert answer["ok"] is False and answer["code"] == 2  # ControlCode.AUTHENTICATION
    captured = credentials.sign("call", body)  # a real request, as sniffed
    assert control_request(server.address, captured)["ok"] is True
    replayed = control_request(server.address, captured)
    assert replayed["ok"] is False and "replayed" in replayed["error"]
    later = credentials.sign("call", body)
    victim.close()  # the client goes: its session ends with its streams
    time.sleep(0.3)
    gone = control_request(server.address, later)
    assert gone["ok"] is False and "unknown or ended session" in gone["error"]


def test_the_clients_own_engine_exposes_nothing(server: _Server) -> None:
    """A StoreClient's engine listens too; a local process that connects to it finds no
    region listed and cannot write a buffer the client registered, even with its key."""
    with _client(server) as client, TransferEngine("intruder") as intruder:
        buffer = np.zeros(BB, np.uint8)
        region = client.register(buffer)
        peer = intruder.connect(client.engine.metadata())
        assert peer.regions == {}
        source = intruder.register(np.full(BB, 0xEE, np.uint8))
        ops = descriptors(region.id, region.key, [(0, BB)])
        from kvbridge.transfer import OP_DTYPE  # noqa: PLC0415

        batch = np.zeros(1, dtype=OP_DTYPE)
        batch["local_region"], batch["remote_region"], batch["length"] = source.id, region.id, BB
        # As if it knew the region, its key, and took it for writable:
        peer.regions = {region.id: RegionInfo(region.id, region.length, "rw", region.key)}
        with pytest.raises(TransferError) as refused:
            peer.write(batch).wait(10)
        assert refused.value.code == ErrorCode.ACCESS_DENIED
        assert not buffer.any()
        del ops


def test_thousands_of_handshakes_and_a_hello_flood_log_nobody_out(server: _Server) -> None:
    """A monitor polling (each poll a new session it abandons), plus unanswered hellos by
    the thousand: a long-lived client keeps its session, and new clients still get in."""
    import zmq  # noqa: PLC0415

    from kvbridge.transfer._control import CONTROL_VERSION, ControlClient  # noqa: PLC0415

    with _client(server) as client:
        ks = keys(0, 2)
        client.put(ks, payloads(ks, BB))
        context = zmq.Context()
        flood = context.socket(zmq.DEALER)
        flood.setsockopt(zmq.LINGER, 0)
        flood.connect(f"tcp://{server.address}")
        for i in range(5000):
            hello = {
                "op": "hello",
                "v": CONTROL_VERSION,
                "name": "x",
                "nonce": i.to_bytes(16, "big"),
            }
            flood.send_multipart([b"", msgpack.packb(hello)])
        poller = ControlClient(context, f"tcp://{server.address}", 10.0)
        for _ in range(4200):  # more than the session table holds
            poller.handshake("monitor", None)
        poller.close()
        flood.close()
        context.term()
        out = np.zeros((2, BB), np.uint8)
        client.get(ks, out)  # still the same session: no "unknown session"
        np.testing.assert_array_equal(out, payloads(ks, BB))
        with _client(server) as newcomer:
            assert newcomer.match_prefix(ks) == 2


# -- fair sharing -----------------------------------------------------------------------


def test_limits_per_request_per_session_and_on_block_size(server: _Server) -> None:
    with _client(server) as client:
        assert client._request_keys == SLOTS // 4
        with pytest.raises(TooManyRequests, match="in one request"):
            _stage(client, keys(0, SLOTS // 4 + 1))
        leases = [_stage(client, keys(0, 2))[0], _stage(client, keys(2, 4))[0]]
        with pytest.raises(TooManyRequests, match="share"):
            _stage(client, keys(4, 5))
        for lease in leases:
            client._call({"op": "abort", "ns": client._ns, "lease": lease})
        client.put(keys(20, 30), payloads(keys(20, 30), BB))  # put chunks within the limits
    for tiny in (1, 4095):
        with pytest.raises(BadRequest, match="block_bytes"):
            StoreClient(server.address, block_bytes=tiny, namespace="tiny")


def test_namespaces_per_session_are_capped_and_idle_ones_reclaimed() -> None:
    server = _Server("--host-capacity", str(64 * BB), "--max-namespaces", "2")
    try:
        first = _client(server, "a")
        second = _client(server, "b")
        with pytest.raises(Exception, match="namespaces"):
            _client(server, "c")  # both in use by live sessions
        first.close()
        time.sleep(0.3)  # first's session ends with its streams: "a" is idle now
        with _client(server, "c") as third:
            third.put(keys(0, 1), payloads(keys(0, 1), BB))
        opened = [
            second.peer.call({"op": "open", "namespace": f"n{i}".encode(), "block_bytes": BB})
            for i in range(3)
        ]
        assert "error" not in opened[0]  # "c" (idle) made way
        assert all("error" in reply for reply in opened[1:])  # the table is full again
        second.close()
    finally:
        server.kill()


def test_one_session_opens_at_most_eight_namespaces() -> None:
    server = _Server("--host-capacity", str(64 * BB), "--max-namespaces", "12")
    try:
        with _client(server, "n0") as client:
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


def test_an_internal_error_is_its_own_kind_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    from kvbridge.store import CacheServer, ServerConfig  # noqa: PLC0415

    secret = "s3cr3t-never-logged"
    config = ServerConfig(port=0, host_capacity=16 * BB, secret=secret.encode())
    with caplog.at_level("DEBUG", logger="kvbridge"), CacheServer(config) as srv:
        with pytest.raises(AuthenticationError):
            StoreClient(srv.address, block_bytes=BB, namespace="m", secret="wrong")
        refused = guess_auth(srv.address)
        assert refused["ok"] is False and refused["code"] == 2
        with StoreClient(srv.address, block_bytes=BB, namespace="m", secret=secret) as client:
            ns = srv._namespaces.snapshot()[0]

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


def test_metrics_need_the_token_when_the_server_has_a_secret() -> None:
    import urllib.error  # noqa: PLC0415
    import urllib.request  # noqa: PLC0415

    from kvbridge.store import CacheServer, ServerConfig, metrics_token  # noqa: PLC0415

    secret = b"metrics-secret"
    config = ServerConfig(port=0, host_capacity=16 * BB, metrics_port=0, secret=secret)
    with CacheServer(config) as srv:
        with StoreClient(srv.address, block_bytes=BB, namespace="tenant-x", secret=secret):
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


def test_a_client_reconnects_after_the_server_restarts(tmp_path: Path) -> None:
    """The old session died with the old server: the client authenticates again on its next
    request, and reads what the restarted server kept on disk."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = ("--host-capacity", "4MiB", "--disk-path", str(tmp_path), "--disk-capacity", "16MiB")
    first = _Server("--port", str(port), *args)
    try:
        client = StoreClient(f"127.0.0.1:{port}", block_bytes=BB, namespace="m")
        ks = keys(0, 4)
        client.put(ks, payloads(ks, BB))
    finally:
        first.kill()
    second = _Server("--port", str(port), *args)
    try:
        out = np.zeros((4, BB), np.uint8)
        client.get(ks, out)
        np.testing.assert_array_equal(out, payloads(ks, BB))
        client.close()
    finally:
        second.kill()


def test_a_full_disk_is_store_full_for_that_put_and_the_server_lives(tmp_path: Path) -> None:
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
        server = _Server(
            "--host-capacity", "8MiB", "--disk-path", str(mount), "--disk-capacity", "64MiB"
        )
        try:
            with _client(server) as client:
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


def test_blocks_larger_than_a_slice_move_through_the_guard() -> None:
    """A 4 MiB block travels as four 1 MiB slices (ops) into one slot: a request of as many
    blocks as a request may cover is still admitted whole."""
    from kvbridge.store import CacheServer, ServerConfig  # noqa: PLC0415

    big = 4 << 20
    config = ServerConfig(port=0, host_capacity=16 * big, max_namespaces=1)
    with (
        CacheServer(config) as srv,
        StoreClient(srv.address, block_bytes=big, namespace="big") as client,
    ):
        ks = keys(0, client._request_keys)
        client.put(ks, payloads(ks, big))
        out = np.zeros((len(ks), big), np.uint8)
        client.get(ks, out)
        np.testing.assert_array_equal(out, payloads(ks, big))


def test_a_namespace_that_is_not_bytes_or_str_is_refused_everywhere(server: _Server) -> None:
    """bytes(5) is five zero bytes: a silent wrong namespace, refused by every entry."""
    from kvbridge.store import InvalidNamespace, TieredStore  # noqa: PLC0415

    for wrong in (5, 2.5, None, ["m"]):
        with pytest.raises(InvalidNamespace):
            StoreClient(server.address, block_bytes=BB, namespace=wrong)  # type: ignore[arg-type]
        with pytest.raises(InvalidNamespace):
            TieredStore(BB, host_capacity=BB, namespace=wrong)  # type: ignore[arg-type]


def test_kvbridge_serve_logs_its_events_on_stderr_and_never_the_secret(tmp_path: Path) -> None:
    secret = "correct horse battery staple"
    (tmp_path / "secret").write_text(secret)
    server = _Server("--host-capacity", "16MiB", "--secret-file", str(tmp_path / "secret"))
    try:
        assert guess_auth(server.address)["ok"] is False
        client = StoreClient(server.address, block_bytes=BB, namespace="m", secret=secret)
        with client, pytest.raises(TooManyRequests):  # one request may not cover 64 blocks
            client._call({"op": "stage", "ns": client._ns, "keys": keys(0, 64)})
    finally:
        server.proc.send_signal(signal.SIGTERM)
        _, err = server.proc.communicate(timeout=30)
    lines = err.splitlines()
    assert any("serving on" in line and "secret=set" in line for line in lines)
    assert any("authentication refused" in line for line in lines)
    assert any("refused stage" in line and "TooManyRequests" in line for line in lines)
    assert secret not in err and "Traceback" not in err


# -- found by an independent attack (each failed before its fix) ------------------------


def test_a_refused_open_reclaims_nothing() -> None:
    """An open that must fail (a block larger than a namespace's share) used to close the
    least recently used idle namespace first, losing its blocks."""
    server = _Server("--host-capacity", "4MiB", "--max-namespaces", "2", "--handoff-ttl", "0")
    try:
        ks = keys(0, 4)
        with _client(server, "tenant-a") as tenant:
            tenant.put(ks, payloads(ks, BB))
        time.sleep(0.3)  # tenant-a is idle now
        with _client(server, "tenant-b"):
            with pytest.raises(StoreFull, match="hold no block"):
                StoreClient(server.address, block_bytes=1 << 30, namespace="huge")
            with _client(server, "tenant-a") as tenant:
                assert tenant.contains(ks) == [True] * 4
    finally:
        server.kill()


def test_a_refused_remove_keeps_the_handoff_holds() -> None:
    """remove([pushed, pinned]) is refused (BlockPinned) and must change nothing: the
    pushed block keeps the hold that keeps it for its first reader."""
    from kvbridge.store import BlockPinned, CacheServer, ServerConfig  # noqa: PLC0415

    config = ServerConfig(port=0, host_capacity=32 * BB, max_namespaces=1, handoff_ttl=30)
    with (
        CacheServer(config) as srv,
        StoreClient(srv.address, block_bytes=BB, namespace="m") as prefill,
        StoreClient(srv.address, block_bytes=BB, namespace="m") as reader,
    ):
        pushed, pinned = keys(0, 1), keys(1, 2)
        prefill.put(pushed + pinned, payloads(pushed + pinned, BB))
        reader._call({"op": "pin", "ns": reader._ns, "keys": pinned})
        with pytest.raises(BlockPinned):
            prefill.remove(pushed + pinned)
        ns = srv._namespaces.snapshot()[0]
        assert pushed[0] in ns.unread  # still held for its first read
        assert ns.store._pins.is_pinned(pushed[0])


def test_a_read_stalled_on_a_released_lease_still_counts_against_the_share() -> None:
    """Pin the share, start a read of it that never drains, release the leases, pin again:
    the stalled read still holds its blocks, so it still counts, and the second pin is
    refused. Before, one session could hold every slot this way."""
    block = 1 << 20
    server = _Server("--host-capacity", str(32 * block), "--max-namespaces", "2")
    try:
        with StoreClient(server.address, block_bytes=block, namespace="m") as client:
            ks = keys(0, 12)
            client.put(ks, payloads(ks, block))
            leases, slots = [], []
            for start in (0, 4):  # the session's share: 8 of 16 slots, 4 per request
                reply = client._call({"op": "pin", "ns": client._ns, "keys": ks[start : start + 4]})
                leases.append(reply["lease"])
                slots += [int(s) for s in reply["slots"]]
            stalled = RawStream(client)
            stalled.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            key = region_key(client, client._region)
            ops = descriptors(client._region, key, [(s * block, block) for s in slots])
            stalled.sock.sendall(stalled.conn.read(1 << 41, ops))  # and never read the answer
            time.sleep(0.5)
            for lease in leases:
                client._call({"op": "release", "ns": client._ns, "lease": lease})
            with pytest.raises(TooManyRequests, match="share"):
                client._call({"op": "pin", "ns": client._ns, "keys": ks[8:12]})
            stalled.close()  # the read ends: its blocks are the session's no longer
            deadline = time.monotonic() + 10
            while True:
                try:
                    client._call({"op": "pin", "ns": client._ns, "keys": ks[8:12]})
                    break
                except TooManyRequests:
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
    finally:
        server.kill()


def test_a_request_of_an_ended_session_is_refused() -> None:
    from kvbridge.store import CacheServer, ServerConfig  # noqa: PLC0415
    from kvbridge.transfer import Caller  # noqa: PLC0415

    with CacheServer(ServerConfig(port=0, host_capacity=16 * BB)) as srv:
        reply = srv._handle(Caller(session=12345, peer="gone"), {"op": "stats"})
        assert reply["kind"] == "BadRequest" and "ended" in reply["message"]
