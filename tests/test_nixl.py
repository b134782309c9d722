"""What only the one-sided ``nixl`` transport has: its link (NIXL metadata only inside an
authenticated session), notifications bound to the session that linked, and its faults
(a killed or frozen target, with NIXL's UCX on shared memory and on TCP), each against a
target in a process of its own. The conformance suite (``test_transfer.py``) runs over
nixl as over the other transports."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from attack import control_request, credentials, nixl_notify, nixl_session
from gpu_moves import gpu_round_trip
from helpers import reap, spawn_python, until
from nixl_lane import NIXL_LANE
from serve import ServeProcess

from kvbridge.store import StoreClient, prefix_hashes
from kvbridge.store._buffers import cupy_module
from kvbridge.transfer import (
    AuthenticationError,
    Caller,
    LocalProtocolError,
    PeerClosed,
    RegionBusy,
    StillInFlight,
    TransferEngine,
    TransferError,
    nixl_available,
)

needs_nixl = pytest.mark.skipif(
    not NIXL_LANE or not nixl_available(),
    reason="NIXL is not installed (pip install --no-deps nixl-cu12)"
    if NIXL_LANE
    else "runs in the nixl lane's process (tests/with_nixl/run): one UCX build a process",
)

MiB = 1 << 20
TLS = {"sm": "sm,self", "tcp": "tcp"}

_TARGET = """
import hashlib, sys
import numpy as np
from kvbridge.transfer import TransferEngine

engine = TransferEngine("target", transports="nixl")
engine.set_notify_handler(lambda caller, message: print("notified", message.hex(), flush=True))
buffer = np.zeros(256 << 20, np.uint8)
engine.register(buffer)
print(engine.metadata().hex(), flush=True)
for line in sys.stdin:
    print(hashlib.blake2b(buffer).hexdigest(), flush=True)
"""
"""A nixl target: prints its metadata, then a digest of its buffer for each stdin line."""


@pytest.fixture(params=list(TLS))
def tls(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("KVBRIDGE_NIXL_UCX_TLS", TLS[request.param])
    return str(request.param)


@pytest.fixture
def target(tls: str) -> Iterator[tuple[subprocess.Popen[str], bytes]]:
    proc = spawn_python(_TARGET)
    assert proc.stdout is not None
    metadata = bytes.fromhex(proc.stdout.readline().strip())
    yield proc, metadata
    reap(proc)


def _digest(proc: subprocess.Popen[str]) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("digest\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


@needs_nixl
def test_a_killed_target_fails_what_is_in_flight_and_what_comes_after(
    target: tuple[subprocess.Popen[str], bytes], tls: str
) -> None:
    """Batches in flight when the target is killed fail well before the 5 s deadline (or
    were done before it died: over shared memory the initiator moves the bytes itself,
    and a batch may be done when ``write`` returns); every batch after it fails; the engine
    goes on with other peers."""
    proc, metadata = target
    with (
        TransferEngine("initiator", transports="nixl", timeout=5.0) as engine,
        TransferEngine("other", transports="nixl") as other,
    ):
        src = engine.register(np.ones(256 * MiB, np.uint8))
        peer = engine.connect(metadata)
        (region,) = peer.regions
        ops = [(src, i * MiB, region, i * MiB, MiB) for i in range(256)]
        handles = [peer.write(ops) for _ in range(8)]
        proc.kill()
        proc.wait(10)
        started = time.monotonic()
        for handle in handles:
            with contextlib.suppress(TransferError):
                peer.wait(handle, 20)
        assert time.monotonic() - started < 4
        with pytest.raises(TransferError):
            peer.wait(peer.write(ops[:1]), 20)
        dst = other.register(np.zeros(MiB, np.uint8))
        here = engine.register(np.full(MiB, 7, np.uint8))
        engine.connect(other.metadata()).write([(here, 0, dst.id, 0, MiB)]).wait(10)
        assert (np.frombuffer(dst.view, np.uint8) == 7).all()


@needs_nixl
def test_a_frozen_target_times_a_notified_write_out(
    target: tuple[subprocess.Popen[str], bytes], tls: str
) -> None:
    """A frozen target answers no notification: the write that carries one fails at the
    deadline, and the target's handler never saw it. Over TCP a plain write fails too, a
    small one that UCX completes once its bytes are in a socket's buffer included: such a
    write is done only when the target says its bytes landed. Over shared memory it is done
    (one-sided: the initiator's process writes the frozen one's memory)."""
    proc, metadata = target
    with TransferEngine("initiator", transports="nixl", timeout=1.0) as engine:
        src = engine.register(np.full(MiB, 9, np.uint8))
        peer = engine.connect(metadata)
        (region,) = peer.regions
        os.kill(proc.pid, signal.SIGSTOP)
        plain = peer.write([(src, 0, region, 0, MiB)])
        small = peer.write([(src, 0, region, 4 * MiB, 8192)])
        for write in (plain, small):
            if tls == "sm":
                write.wait(10)
            else:
                with pytest.raises(TransferError, match=r"not done after 1\.0 s"):
                    write.wait(10)
        with pytest.raises(TransferError, match=r"not done after 1\.0 s"):
            peer.write([(src, 0, region, MiB, MiB)], notify=b"late").wait(10)


@needs_nixl
def test_a_read_nixl_cannot_stop_keeps_its_memory_busy(
    target: tuple[subprocess.Popen[str], bytes], tls: str
) -> None:
    """A read from a frozen target over UCX TCP fails at its deadline with
    ``StillInFlight``: NIXL let go of it but cannot stop its bytes (NIXL 1.5.1; see
    ``_nixl``), so its buffer stays busy (``unregister`` refuses it) instead of being handed
    back as if nothing could land in it. The engine goes on with a fresh peer."""
    proc, metadata = target
    if tls == "sm":
        pytest.skip("over shared memory (cma) a one-sided op is done when posted")
    with TransferEngine("initiator", transports="nixl", timeout=1.0) as engine:
        mine = engine.register(np.full(64 * MiB, 5, np.uint8))
        peer = engine.connect(metadata)
        (region,) = peer.regions
        os.kill(proc.pid, signal.SIGSTOP)
        with pytest.raises(StillInFlight, match="may still land"):
            peer.read([(mine, 0, region, 0, 64 * MiB)]).wait(10)
        with pytest.raises(RegionBusy):
            engine.unregister(mine)
        os.kill(proc.pid, signal.SIGCONT)
        _digest(proc)  # the target runs again
        other = engine.register(np.zeros(MiB, np.uint8))
        engine.connect(metadata).read([(other, 0, region, 0, MiB)]).wait(10)
        engine.unregister(other)


@needs_nixl
def test_a_link_needs_a_live_session() -> None:
    """The agent metadata goes only to a signed link request: without a session, with one
    that ended, or with a forged signature, the target refuses it and loads nothing."""
    with (
        TransferEngine("target", transports="nixl") as target,
        TransferEngine("initiator", transports="nixl") as initiator,
    ):
        peer = initiator.connect(target.metadata())
        session = credentials(peer)
        forged = {**session.sign("link", b"\x80"), "mac": bytes(32)}
        answer = control_request(target.address, forged)
        assert not answer["ok"] and "signature" in answer["error"]
        unknown = {**session.sign("link", b"\x80"), "session": bytes(16)}
        answer = control_request(target.address, unknown)
        assert not answer["ok"] and "session" in answer["error"]
        answer = control_request(target.address, {"op": "link", "body": b"\x80"})
        assert not answer["ok"]


@needs_nixl
def test_a_notification_counts_only_for_the_session_that_linked() -> None:
    """An agent that names another session's serial in a notification is not heard: the
    target's handler sees notifications only with the caller whose link they came over."""
    seen: list[Caller] = []
    with (
        TransferEngine("target", transports="nixl") as target,
        TransferEngine("alice", transports="nixl") as alice,
        TransferEngine("mallory", transports="nixl") as mallory,
    ):
        target.set_notify_handler(lambda caller, message: seen.append(caller))
        mine = alice.connect(target.metadata())
        theirs = mallory.connect(target.metadata())
        nixl_notify(mallory, theirs, nixl_session(mine), b"as alice")
        theirs.write([], notify=b"as mallory").wait(5)
        mine.write([], notify=b"as alice, really").wait(5)
        assert [c.peer for c in seen] == ["mallory", "alice"]


@needs_nixl
def test_two_peers_of_one_engine_share_its_agent() -> None:
    """An engine's peers to one target (a connector's pool of clients) link one agent
    through sessions of their own; closing one leaves the other working."""
    with (
        TransferEngine("target", transports="nixl") as target,
        TransferEngine("initiator", transports="nixl") as initiator,
    ):
        dst = target.register(np.zeros(MiB, np.uint8))
        src = initiator.register(np.full(MiB, 4, np.uint8))
        first, second = (initiator.connect(target.metadata()) for _ in range(2))
        first.write([(src, 0, dst.id, 0, 4096)], notify=b"1").wait(5)
        first.close()
        second.write([(src, 0, dst.id, 4096, 4096)], notify=b"2").wait(5)
        with pytest.raises(PeerClosed):
            first.write([(src, 0, dst.id, 0, 4096)])
        first.reconnect()
        first.write([(src, 0, dst.id, 8192, 4096)], notify=b"3").wait(5)
        assert [n.message for n in target.notifications(timeout=5)] == [b"1", b"2", b"3"]
        assert (np.frombuffer(dst.view, np.uint8)[: 3 * 4096] == 4).all()


@needs_nixl
def test_the_transport_is_refused_where_nixl_does_not_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without NIXL the engine says what to install, in one line, and starts nothing."""
    import kvbridge.transfer._engine as engine_module  # noqa: PLC0415

    monkeypatch.setattr(engine_module, "nixl_available", lambda: False)
    with pytest.raises(Exception, match="pip install --no-deps nixl-cu12"):
        TransferEngine(transports="nixl")


@needs_nixl
def test_the_session_ends_and_the_link_goes_with_it() -> None:
    """A peer that says goodbye ends its session: the target forgets the link, and a
    notification the peer's agent sends after it reaches no handler."""
    seen: list[bytes] = []
    with (
        TransferEngine("target", transports="nixl") as target,
        TransferEngine("initiator", transports="nixl") as initiator,
    ):
        ended: list[Caller] = []
        target.set_session_end_handler(ended.append)
        target.set_notify_handler(lambda caller, message: seen.append(message))
        peer = initiator.connect(target.metadata())
        peer.write([], notify=b"before").wait(5)
        serial = nixl_session(peer)
        other = initiator.connect(target.metadata())  # keeps the agent loaded there
        answer = control_request(target.address, credentials(peer).sign("bye", b""))
        assert answer["ok"]
        until(lambda: bool(ended), "the session ended")
        nixl_notify(initiator, other, serial, b"after")
        other.write([], notify=b"other").wait(5)
        assert seen == [b"before", b"other"]
        with pytest.raises(AuthenticationError):
            control_request_raising(target.address, credentials(peer).sign("link", b"\x80"))


def control_request_raising(address: str, message: dict[str, object]) -> None:
    answer = control_request(address, message)
    if not answer["ok"]:
        raise AuthenticationError(str(answer["error"]))


@needs_nixl
def test_nixl_server_refuses_tenants(tmp_path: Path) -> None:
    """``kvbridge serve --transports nixl --tenants ...`` stops with one line and status 2:
    a one-sided transport cannot keep tenants apart (a client reaches the server's memory
    itself), and nothing is served meanwhile."""
    (tmp_path / "a.secret").write_text("secret of a\n")
    (tmp_path / "tenants.toml").write_text('[[tenant]]\nname = "a"\nsecret_file = "a.secret"\n')
    tenants = str(tmp_path / "tenants.toml")
    serve = [sys.executable, "-m", "kvbridge", "serve", "--port", "0", "--transports", "nixl"]
    done = subprocess.run(
        [*serve, "--tenants", tenants],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert "nixl" in line and "tenants" in line and "Traceback" not in line


@needs_nixl
def test_a_server_over_nixl_keeps_puts_and_gets_whole() -> None:
    """A cache server over nixl: a client's put commits on the notification (the server's
    handler ran), another client's get reads the same bytes, and a put refused by the
    server's handler (its lease gone) stores nothing and says so with the store's error."""
    server = ServeProcess("--transports", "nixl", "--host-capacity", "16MiB")
    try:
        blocks = np.random.default_rng(3).integers(0, 256, (8, 64 << 10), dtype=np.uint8)
        keys = prefix_hashes(list(range(8 * 16)), 16)
        with (
            StoreClient(server.address, block_bytes=64 << 10, transports="nixl") as writer,
            StoreClient(server.address, block_bytes=64 << 10, transports="nixl") as reader,
        ):
            assert writer.peer.transport == reader.peer.transport == "nixl"
            assert writer.put(keys, blocks) == [True] * 8
            out = np.zeros_like(blocks)
            reader.get(keys, out)
            np.testing.assert_array_equal(out, blocks)
            assert reader.contains(keys) == [True] * 8
    finally:
        server.kill()


def test_nixl_is_tested_where_it_is_installed() -> None:
    """The nixl suites may skip only where NIXL's wheel is not installed: an installed wheel
    that does not load fails here instead of skipping every nixl case in silence."""
    import importlib.util  # noqa: PLC0415

    if not NIXL_LANE:
        pytest.skip("runs in the nixl lane's process (tests/with_nixl/run)")
    if importlib.util.find_spec("nixl_cu12") is None and importlib.util.find_spec("nixl") is None:
        pytest.skip("NIXL is not installed: pip install --no-deps nixl-cu12==1.5.1")
    assert nixl_available(), "NIXL is installed but does not load"
    with TransferEngine(transports="nixl") as a, TransferEngine(transports="nixl") as b:
        assert a.connect(b.metadata()).transport == "nixl"


@needs_nixl
@pytest.mark.skipif(cupy_module() is None, reason="cupy with a CUDA GPU is not available")
def test_gpu_memory_moves_as_it_is_over_nixl() -> None:
    """GPU memory registered with NIXL as VRAM, moved one-sided (``gpu_moves``)."""
    gpu_round_trip("nixl")


@needs_nixl
def test_the_ucx_transport_is_refused_beside_nixl() -> None:
    """NIXL's UCX and ucxx's do not share a process: once an engine ran nixl here, one that
    asks for ucx is refused, saying why, before ucxx makes a context."""
    with TransferEngine(transports="nixl"):
        pass
    with pytest.raises(LocalProtocolError, match=r"their UCX libraries clash|needs ucxx"):
        TransferEngine(transports="ucx")


@needs_nixl
def test_auto_takes_nixl_only_asked_for_here() -> None:
    """``transports="auto"`` where ucxx is installed beside NIXL (this venv): an engine
    that serves never offers nixl by itself (a one-sided peer reaches any byte it
    registered), and once nixl holds this process's UCX, auto takes tcp rather than a ucx
    that would be refused. (Where ucxx is not installed, a dialing auto engine takes nixl:
    ``tests/with_vllm/test_vllm_nixl.py``.)"""
    with (
        TransferEngine("nixl-side", transports=("nixl", "tcp")) as nixl_side,
        TransferEngine("auto-side", transports="auto") as auto_side,
    ):
        assert nixl_side.connect(auto_side.metadata()).transport == "tcp"
        assert auto_side.connect(nixl_side.metadata()).transport == "tcp"
