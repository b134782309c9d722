"""Transport conformance: every transport passes the same suite (tcp, memory, ucx, and
nixl with NIXL's UCX on shared memory and on TCP). What a one-sided transport cannot do
(the target checking an op itself, data-stream greetings) is skipped for nixl, saying why;
``test_nixl.py`` has what only nixl has."""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import xxhash
from attack import credentials, data_pipe, region_in_use
from hypothesis import given, settings
from hypothesis import strategies as st
from nixl_lane import NIXL_LANE

from kvbridge.transfer import (
    OP_DTYPE,
    AuthenticationError,
    Caller,
    Digests,
    EngineClosed,
    LocalProtocolError,
    PeerClosed,
    RegionBusy,
    RegionInfo,
    TransferEngine,
    TransferError,
    nixl_available,
    ucx_available,
)
from kvbridge.transfer._protocol import ErrorCode
from kvbridge.transfer._streams import InitiatorStream
from kvbridge.transfer.testing import corrupt_received

# Every transport passes this suite; ucx runs wherever ucxx imports (it does on CPU), nixl
# wherever NIXL's wheel loads (nixl-cu12, installed --no-deps; it does on CPU).
NIXL = {"nixl-sm": "sm,self", "nixl-tcp": "tcp"}
"""The nixl cases: NIXL's UCX on shared memory (``cma`` moves the bytes) and on TCP."""
TRANSPORTS = (
    (list(NIXL) if nixl_available() else [])
    if NIXL_LANE
    else ["tcp", "memory"] + (["ucx"] if ucx_available() else [])
)
"""In the nixl lane (``tests/with_nixl/run`` runs this suite again in a process of its own,
``KVBRIDGE_TEST_NIXL=1``) the nixl cases; otherwise the others: NIXL's UCX and ucxx's do
not share a process (``transfer/_ucx_builds.py``)."""
ONE_SIDED = "one-sided (nixl): the target checks nothing and runs no data streams (docs/ACCESS.md)"


def test_ucx_is_tested_where_it_is_installed() -> None:
    """The UCX suite may skip only where ucxx is not installed: an installed ucxx that does
    not import (a broken UCX library, say) fails here instead of skipping every UCX case in
    silence, and the ucx transport is really the one a peer then uses."""
    if NIXL_LANE:
        pytest.skip("the nixl lane's process runs no ucx (transfer/_ucx_builds.py)")
    if importlib.util.find_spec("ucxx") is None:
        pytest.skip("ucxx is not installed: pip install 'kvbridge[ucx]' to run the UCX suite")
    assert ucx_available(), "ucxx is installed but its bindings do not import"
    with TransferEngine(transports="ucx") as a, TransferEngine(transports="ucx") as b:
        assert a.connect(b.metadata()).transport == "ucx"


MiB = 1 << 20


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The transport's name; for a nixl case, NIXL's UCX transports set for the engines."""
    name = str(request.param)
    if name in NIXL:
        monkeypatch.setenv("KVBRIDGE_NIXL_UCX_TLS", NIXL[name])
        return "nixl"
    return name


@pytest.fixture
def pair(transport: str) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    with (
        TransferEngine("initiator", transports=(transport,), timeout=5.0) as a,
        TransferEngine("target", transports=(transport,), timeout=5.0) as b,
    ):
        yield a, b


def _random(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def test_write_then_read_back_a_large_op(pair: tuple[TransferEngine, TransferEngine]) -> None:
    a, b = pair
    src, dst, back = (
        _random(9 * MiB + 123),
        np.zeros(10 * MiB, np.uint8),
        np.zeros(9 * MiB + 123, np.uint8),
    )
    src_r, back_r = a.register(src, access="r"), a.register(back)
    dst_r = b.register(dst)
    peer = a.connect(b.metadata())
    handle = peer.write([(src_r, 0, dst_r.id, 77, src.nbytes)])
    handle.wait(10)
    assert handle.done and handle.bytes == src.nbytes
    np.testing.assert_array_equal(dst[77 : 77 + src.nbytes], src)
    assert not dst[:77].any() and not dst[77 + src.nbytes :].any()
    peer.read([(back_r, 0, dst_r.id, 77, src.nbytes)]).wait(10)
    np.testing.assert_array_equal(back, src)
    stats = a.stats()
    assert stats["bytes_written"] == stats["bytes_read"] == src.nbytes
    one_sided = stats["peers"][0]["transport"] == "nixl"
    assert b.stats()["served_bytes_in"] == (0 if one_sided else src.nbytes)
    assert stats["peers"][0]["transport"] in [*TRANSPORTS, "nixl"]


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(st.data())
def test_many_small_shuffled_ops_land_exactly(data: st.DataObject) -> None:
    for case in TRANSPORTS:
        transport = "nixl" if case in NIXL else case
        with (
            TransferEngine(transports=(transport,)) as a,
            TransferEngine(transports=(transport,)) as b,
        ):
            block = data.draw(st.sampled_from([1, 100, 4096, 70_000]))
            count = data.draw(st.integers(1, 3000 if block < 5000 else 40))
            src, dst = _random(block * count, seed=count), np.zeros(block * count, np.uint8)
            order = np.random.default_rng(block).permutation(count)
            ops = np.zeros(count, OP_DTYPE)
            s, d = a.register(src), b.register(dst)
            ops["local_region"], ops["remote_region"] = s.id, d.id
            ops["local_offset"] = np.arange(count) * block
            ops["remote_offset"] = order * block
            ops["length"] = block
            a.connect(b.metadata()).write(ops).wait(20)
            expected = np.zeros_like(dst).reshape(count, block)
            expected[order] = src.reshape(count, block)
            np.testing.assert_array_equal(dst.reshape(count, block), expected)


def test_notification_arrives_after_the_bytes(pair: tuple[TransferEngine, TransferEngine]) -> None:
    a, b = pair
    src, dst = _random(4 * MiB), np.zeros(4 * MiB, np.uint8)
    s, d = a.register(src), b.register(dst)
    peer = a.connect(b.metadata())
    seen: list[bool] = []

    def watcher() -> None:
        (note,) = b.notifications(timeout=10)
        seen.append(bool((dst == src).all()) and note.message == b"req-7" and note.peer == a.name)

    thread = threading.Thread(target=watcher)
    thread.start()
    peer.write([(s, 0, d.id, 0, src.nbytes)], notify=b"req-7").wait(10)
    thread.join(10)
    assert seen == [True]
    peer.write([], notify=b"only").wait(10)  # a notification alone
    assert [n.message for n in b.notifications(timeout=5)] == [b"only"]


def test_an_empty_batch_is_done_at_once(pair: tuple[TransferEngine, TransferEngine]) -> None:
    a, b = pair
    peer = a.connect(b.metadata())
    for handle in (peer.write([]), peer.read([]), peer.write(np.zeros(0, OP_DTYPE))):
        assert handle.done and handle.bytes == 0
        handle.wait(0)
    assert a.stats()["batches"] == 3


def test_handles_are_awaitable(pair: tuple[TransferEngine, TransferEngine]) -> None:
    a, b = pair
    src, dst = _random(MiB), np.zeros(MiB, np.uint8)
    s, d = a.register(src), b.register(dst)
    peer = a.connect(b.metadata())

    async def main() -> int:
        handles = [peer.write([(s, i * 4096, d.id, i * 4096, 4096)]) for i in range(256)]
        await asyncio.gather(*handles)
        return sum(h.bytes for h in handles)

    assert asyncio.run(main()) == MiB
    np.testing.assert_array_equal(dst, src)


def test_local_checks_reject_before_anything_moves(
    pair: tuple[TransferEngine, TransferEngine],
) -> None:
    a, b = pair
    src = a.register(_random(1000))
    ro = b.register(np.zeros(100, np.uint8), access="r")
    wo = b.register(np.zeros(100, np.uint8), access="w")
    peer = a.connect(b.metadata())
    bad = [
        [(src, 0, wo.id, 50, 51)],  # past the end of the remote region
        [(src, 990, wo.id, 0, 20)],  # past the end of the local region
        [(src, 0, ro.id, 0, 10)],  # write into a read-only region
        [(src, 0, 999, 0, 10)],  # no such remote region
        [(src, 0, wo.id, 0, 0)],  # empty op
        [(src, -1, wo.id, 0, 10)],  # negative offset
        [(src, 0, wo.id, 0)],  # not a 5-tuple
        "nonsense",
    ]
    for ops in bad:
        with pytest.raises(LocalProtocolError):
            peer.write(ops)
    with pytest.raises(LocalProtocolError, match="does not allow 'r'"):
        peer.read([(src, 0, wo.id, 0, 10)])
    with pytest.raises(LocalProtocolError, match="op 1"):
        peer.write([(src, 0, wo.id, 0, 10), (src, 0, wo.id, 95, 10)])
    assert b.stats()["served_bytes_in"] == 0


@pytest.mark.parametrize(
    ("access", "tamper", "reason"),
    [
        ("w", lambda i: RegionInfo(i.id, i.length, i.access, i.key ^ 1), "wrong access key"),
        ("w", lambda i: RegionInfo(i.id, i.length * 2, i.access, i.key), "outside region"),
        ("r", lambda i: RegionInfo(i.id, i.length, "rw", i.key), "does not allow"),
        ("w", lambda i: RegionInfo(i.id + 100, i.length, i.access, i.key), "no region"),
    ],
)
def test_the_target_checks_every_op_itself(
    pair: tuple[TransferEngine, TransferEngine], access: str, tamper: object, reason: str
) -> None:
    """A peer with forged metadata is refused by the target before a byte is written."""
    a, b = pair
    if "nixl" in a.stats()["transports"]:
        pytest.skip(ONE_SIDED)
    src = a.register(_random(4096))
    target = np.zeros(2048, np.uint8)
    t = b.register(target, access=access)
    peer = a.connect(b.metadata())
    forged = tamper(peer.regions[t.id])  # type: ignore[operator]
    peer.regions[forged.id] = forged
    ops = [(src, 0, forged.id, 0, 1024), (src, 1024, forged.id, 1024, forged.length - 1024)]
    with pytest.raises(TransferError, match=reason) as info:
        peer.write(ops).wait(10)
    assert info.value.op_index in (0, 1)
    assert not target.any()
    # The stream is still good: a legal op on the same peer works.
    ok = b.register(np.zeros(16, np.uint8), access="w")
    peer.refresh()
    peer.write([(src, 0, ok.id, 0, 16)]).wait(10)


def test_unregister_refuses_while_a_transfer_uses_the_region() -> None:
    with TransferEngine(transports=("memory",)) as a:
        region = a.register(np.zeros(10, np.uint8))
        with region_in_use(a, region), pytest.raises(RegionBusy):
            a.unregister(region)
        a.unregister(region)
        with pytest.raises(LocalProtocolError):
            a.unregister(region)


@pytest.mark.parametrize(
    ("secret_a", "secret_b", "ok"),
    [
        ("s3cret", "s3cret", True),
        ("s3cret", "other", False),
        (None, "s3cret", False),
        ("s3cret", None, False),
    ],
)
def test_shared_secret_handshake(
    transport: str, secret_a: str | None, secret_b: str | None, ok: bool
) -> None:
    with (
        TransferEngine(transports=(transport,), secret=secret_a) as a,
        TransferEngine(transports=(transport,), secret=secret_b) as b,
    ):
        src, dst = a.register(_random(64)), b.register(np.zeros(64, np.uint8))
        if ok:
            a.connect(b.metadata()).write([(src, 0, dst.id, 0, 64)]).wait(5)
        else:
            with pytest.raises(AuthenticationError):
                a.connect(b.metadata())


def test_a_stream_greeting_must_prove_a_live_session(transport: str) -> None:
    """What a stranger or an eavesdropper can send on a data port: garbage, a real session
    id with a MAC made without the session key, or a real greeting seen once and replayed."""
    if transport == "nixl":
        pytest.skip(ONE_SIDED)
    with TransferEngine(transports=(transport,)) as a, TransferEngine(transports=(transport,)) as b:
        peer = a.connect(b.metadata())  # a live session, its id visible on the wire
        session = credentials(peer)

        def stream() -> InitiatorStream:
            return InitiatorStream(data_pipe(b, a), 0, lambda reason: None)

        attempts = [
            (bytes(64), "unknown or ended session"),
            (session.id + bytes(48), "signature"),
        ]
        for greeting, reason in attempts:
            refused = stream()
            with pytest.raises(AuthenticationError, match=reason) as caught:
                refused.handshake(greeting, 5)
            assert caught.value.code == ErrorCode.AUTHENTICATION
            refused.close()
        seen = session.hello(0)
        first, second = stream(), stream()
        first.handshake(seen, 5)  # the real client's greeting
        with pytest.raises(AuthenticationError, match="replayed"):
            second.handshake(seen, 5)  # the same bytes again
        first.close()
        second.close()


def test_close_joins_every_thread(transport: str) -> None:
    before = threading.active_count()
    a = TransferEngine(transports=(transport,))
    b = TransferEngine(transports=(transport,))
    src, dst = a.register(_random(MiB)), b.register(np.zeros(MiB, np.uint8))
    a.connect(b.metadata()).write([(src, 0, dst.id, 0, MiB)]).wait(10)
    assert threading.active_count() > before
    a.close()
    b.close()
    a.close()  # idempotent
    assert threading.active_count() == before
    with pytest.raises(EngineClosed):
        a.register(np.zeros(1, np.uint8))


def test_closed_peer_fails_fast_and_reconnects(pair: tuple[TransferEngine, TransferEngine]) -> None:
    a, b = pair
    src, dst = a.register(_random(4096)), b.register(np.zeros(4096, np.uint8))
    peer = a.connect(b.metadata())
    peer.close()
    with pytest.raises(PeerClosed):
        peer.write([(src, 0, dst.id, 0, 4096)])
    peer.reconnect()
    peer.write([(src, 0, dst.id, 0, 4096)]).wait(5)


def test_unknown_settings_and_transports_are_refused() -> None:
    with pytest.raises(LocalProtocolError, match="unknown settings"):
        TransferEngine(stream=3)
    with pytest.raises(LocalProtocolError, match="transports"):
        TransferEngine(transports=("carrier-pigeon",))
    with pytest.raises(LocalProtocolError):
        TransferEngine(streams=0)


def test_metadata_garbage_is_refused() -> None:
    with TransferEngine(transports=("memory",)) as a:
        for junk in (b"", b"\x93\x01\x02\x03", b"\xc1", b"{}"):
            with pytest.raises(LocalProtocolError):
                a.connect(junk)


def test_a_notify_handler_can_refuse_a_batch(transport: str) -> None:
    from kvbridge.transfer import NotifyRefused  # noqa: PLC0415

    seen: list[tuple[str, bytes]] = []

    def handler(caller: Caller, message: bytes) -> None:
        if message == b"no":
            raise NotifyRefused("not today", code=1234)
        seen.append((caller.peer, message))

    with (
        TransferEngine("a", transports=transport, timeout=5.0) as a,
        TransferEngine("b", transports=transport, timeout=5.0) as b,
    ):
        b.set_notify_handler(handler)
        src, dst = np.ones(4096, np.uint8), np.zeros(4096, np.uint8)
        here, there = a.register(src), b.register(dst)
        peer = a.connect(b.metadata())
        peer.write([(here, 0, there.id, 0, 4096)], notify=b"yes").wait(5)
        assert seen == [("a", b"yes")] and b.notifications() == []
        with pytest.raises(TransferError, match="not today") as refused:
            peer.write([(here, 0, there.id, 0, 4096)], notify=b"no").wait(5)
        assert refused.value.code == 1234  # the handler's own code reaches the writer
        peer.write([(here, 0, there.id, 0, 4096)], notify=b"again").wait(5)  # still up
        assert seen[-1] == ("a", b"again")


def _layout(kind: str, blocks: int, block: int) -> tuple[list[np.ndarray], np.ndarray, int]:
    """A batch's local side and its groups: ``pages``, 4 buffers holding a quarter of each
    block (a KV cache's layers); ``contiguous``, one buffer (ops that merge and slice)."""
    if kind == "pages":
        layers = [_random(blocks * block // 4, seed=i) for i in range(4)]
        rows = [
            (layer, b * block // 4, b * block + layer * block // 4, block // 4)
            for b in range(blocks)
            for layer in range(4)
        ]
        return layers, np.array(rows, dtype=np.int64), 4
    whole = _random(blocks * block, seed=9)
    rows = [(0, b * block, b * block, block) for b in range(blocks)]
    return [whole], np.array(rows, dtype=np.int64), 1


def _block_sums(buffers: list[np.ndarray], rows: np.ndarray, per_block: int) -> list[int]:
    sums = []
    for start in range(0, len(rows), per_block):
        state = xxhash.xxh3_64()
        for layer, at, _, n in rows[start : start + per_block].tolist():
            state.update(memoryview(buffers[layer])[at : at + n])
        sums.append(state.intdigest())
    return sums


@pytest.mark.parametrize("kind", ["pages", "contiguous"])
@pytest.mark.parametrize("frame_bytes", [64 << 10, 16 << 20], ids=["small-frames", "one-frame"])
def test_digests_are_each_groups_xxh3_however_the_batch_is_cut(
    transport: str, kind: str, frame_bytes: int
) -> None:
    """Pages one op each, or blocks that merge into one op and are sliced again; frames that
    hold many groups, or cut through them: each group's digest, written and read, is the
    XXH3-64 of its bytes one after another, as the other side holds them."""
    blocks, block = 24, 48 << 10
    limits: dict[str, Any] = {"frame_bytes": frame_bytes, "slice_bytes": 16 << 10}
    with (
        TransferEngine(transports=(transport,), timeout=10.0, **limits) as a,
        TransferEngine(transports=(transport,), timeout=10.0, **limits) as b,
    ):
        buffers, rows, per_block = _layout(kind, blocks, block)
        remote = np.zeros(blocks * block, np.uint8)
        regions, target = [a.register(x) for x in buffers], b.register(remote)
        ops = np.zeros(len(rows), OP_DTYPE)
        ops["local_region"] = [regions[i].id for i in rows[:, 0]]
        ops["local_offset"], ops["remote_offset"], ops["length"] = (
            rows[:, 1],
            rows[:, 2],
            rows[:, 3],
        )
        ops["remote_region"] = target.id
        peer = a.connect(b.metadata())
        expected = _block_sums(buffers, rows, per_block)
        written = Digests(range(0, len(ops), per_block))
        peer.write(ops, digests=written).wait(10)
        assert written.values() == expected
        for x in buffers:
            x[:] = 0
        read = Digests(range(0, len(ops), per_block))
        peer.read(ops, digests=read).wait(10)
        assert read.values() == expected == _block_sums(buffers, rows, per_block)


def test_a_read_digest_is_of_the_bytes_that_landed_not_those_sent(
    pair: tuple[TransferEngine, TransferEngine], transport: str
) -> None:
    """A receive buffer damaged as the bytes land (a faulty NIC, through the test seam): the
    digest is of what landed, so a reader comparing it with the writer's sees the damage."""
    if transport == "nixl":
        pytest.skip(f"{ONE_SIDED}: no receive path of kvbridge's to damage")
    a, b = pair
    src, dst = _random(256 << 10), np.zeros(256 << 10, np.uint8)
    s, d = b.register(src), a.register(dst)
    peer = a.connect(b.metadata())
    ops = [(d, i * (32 << 10), s.id, i * (32 << 10), 32 << 10) for i in range(8)]

    def flip(views: Sequence[memoryview]) -> None:
        views[0][0] ^= 0xFF

    digests = Digests(range(0, 8, 4))
    with corrupt_received(flip):
        peer.read(ops, digests=digests).wait(10)
    assert dst[0] == src[0] ^ 0xFF
    got = digests.values()
    assert got == [
        xxhash.xxh3_64_intdigest(dst[: 128 << 10].tobytes()),
        xxhash.xxh3_64_intdigest(dst[128 << 10 :].tobytes()),
    ]
    assert got[0] != xxhash.xxh3_64_intdigest(src[: 128 << 10].tobytes())


@pytest.mark.parametrize("starts", [[1, 2], [0, 2, 2], [0, 3, 1], [0, 8], [0, -1]])
def test_digest_groups_that_do_not_cut_the_batch_are_refused_before_a_byte_moves(
    pair: tuple[TransferEngine, TransferEngine], starts: list[int]
) -> None:
    a, b = pair
    src, dst = _random(8 << 10), np.zeros(8 << 10, np.uint8)
    s, d = a.register(src), b.register(dst)
    peer = a.connect(b.metadata())
    ops = [(s, i << 10, d.id, i << 10, 1 << 10) for i in range(8)]
    with pytest.raises(LocalProtocolError, match="digest groups"):
        peer.write(ops, digests=Digests(starts))
    assert not dst.any()
    used = Digests([0])
    peer.write(ops, digests=used).wait(10)
    with pytest.raises(LocalProtocolError, match="one batch"):
        peer.write(ops, digests=used)


def test_a_notification_that_cannot_be_made_fails_its_batch_and_not_the_peer(
    pair: tuple[TransferEngine, TransferEngine],
) -> None:
    a, b = pair
    src, dst = _random(64 << 10), np.zeros(64 << 10, np.uint8)
    s, d = a.register(src), b.register(dst)
    peer = a.connect(b.metadata())

    def broken() -> bytes:
        raise RuntimeError("no commit to make")

    with pytest.raises(LocalProtocolError, match="no commit to make"):
        peer.write([(s, 0, d.id, 0, src.nbytes)], notify=broken).wait(10)
    with pytest.raises(LocalProtocolError, match="notify must be bytes"):
        peer.write([(s, 0, d.id, 0, src.nbytes)], notify=lambda: b"x" * (1 << 17)).wait(10)
    assert b.notifications(timeout=0) == []
    peer.write([(s, 0, d.id, 0, src.nbytes)], notify=lambda: b"made").wait(10)
    assert [n.message for n in b.notifications(timeout=5)] == [b"made"]


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_digests_hold_for_any_ops_groups_and_frames(data: st.DataObject) -> None:
    """Ops of any sizes, contiguous (they merge) or scattered, cut into any groups, planned
    into frames and slices of any size: every group's digest is its bytes' XXH3-64."""
    count = data.draw(st.integers(1, 40))
    lengths = data.draw(st.lists(st.integers(1, 40_000), min_size=count, max_size=count))
    gaps = data.draw(st.sampled_from([0, 1]))  # 0: each op continues the last on both sides
    cuts = data.draw(st.sets(st.integers(1, count - 1))) if count > 1 else set()
    slice_bytes = data.draw(st.sampled_from([4096, 20_000, 1 << 20]))
    frame_bytes = max(slice_bytes, data.draw(st.sampled_from([4096, 50_000, 16 << 20])))
    offsets = np.cumsum([0, *[n + gaps for n in lengths]])
    src, dst = _random(int(offsets[-1]) + 1, seed=count), np.zeros(int(offsets[-1]) + 1, np.uint8)
    engine: dict[str, Any] = {"slice_bytes": slice_bytes, "frame_bytes": frame_bytes}
    with (
        TransferEngine(transports=("tcp",), **engine) as a,
        TransferEngine(transports=("tcp",), **engine) as b,
    ):
        s, d = a.register(src), b.register(dst)
        ops = [(s, int(offsets[i]), d.id, int(offsets[i]), lengths[i]) for i in range(count)]
        groups = [0, *sorted(cuts)]
        bounds = [*groups, count]
        expected = [
            xxhash.xxh3_64_intdigest(src[offsets[g] : offsets[h - 1] + lengths[h - 1]].tobytes())
            if not gaps
            else _joined(src, offsets[g:h], lengths[g:h])
            for g, h in itertools.pairwise(bounds)
        ]
        peer = a.connect(b.metadata())
        written, read = Digests(groups), Digests(groups)
        peer.write(ops, digests=written).wait(10)
        src[:] = 0
        peer.read(ops, digests=read).wait(10)
        assert written.values() == expected == read.values()


def _joined(data: np.ndarray, offsets: np.ndarray, lengths: list[int]) -> int:
    return xxhash.xxh3_64_intdigest(
        b"".join(data[o : o + n].tobytes() for o, n in zip(offsets.tolist(), lengths, strict=True))
    )
