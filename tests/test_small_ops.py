"""The small-batch fast paths decide exactly as the vectorised ones: the same frames' bytes,
the same refusals naming the same op. Random batches, good and bad, through both."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.transfer import OP_DTYPE, AccessDenied, LocalProtocolError
from kvbridge.transfer._ops import FramePlan, check, normalize, plan
from kvbridge.transfer._protocol import DESCRIPTOR, SMALL_OPS
from kvbridge.transfer._regions import Region, RegionInfo, RegionTable
from kvbridge.transfer._sessions import Caller
from kvbridge.transfer._small import plan_small, small_rows

SLICE = 64 << 10
SIZES = (4096, 65536, 1 << 20)


def _tables() -> tuple[RegionTable, dict[int, RegionInfo]]:
    local = RegionTable()
    local.register(bytearray(SIZES[0]), "rw")
    local.register(bytes(SIZES[1]), "r")  # read-only memory
    local.register(bytearray(SIZES[2]), "rw")
    remote = RegionTable()
    remote.register(bytearray(SIZES[0]), "rw")
    remote.register(bytearray(SIZES[1]), "r")
    remote.register(bytearray(SIZES[2]), "w")
    return local, {r.id: r for r in remote.infos()}


_op = st.tuples(
    st.integers(1, 4),  # region 4 does not exist
    st.integers(0, 70_000),
    st.integers(1, 4),
    st.integers(0, 70_000),
    st.integers(0, 9_000),  # 0 is refused
)


def _outcome(fn: object) -> object:
    try:
        return fn()  # type: ignore[operator]
    except (LocalProtocolError, AccessDenied) as exc:
        return (type(exc), exc.op_index)


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(st.lists(_op, min_size=1, max_size=SMALL_OPS), st.sampled_from(["r", "w"]))
def test_the_small_plan_decides_as_the_general_one(
    rows: list[tuple[int, ...]], access: str
) -> None:
    local, remote = _tables()
    ops = np.array(rows, OP_DTYPE)

    def general() -> tuple[list[int], bytes, list[bytes]]:
        batch = normalize(ops)
        regions = check(batch, local, remote, access)
        frames = plan(batch, local, remote, slice_bytes=SLICE, frame_bytes=SLICE, streams=1)
        return _flat(regions, frames)

    def small() -> tuple[list[int], bytes, list[bytes]] | None:
        found = small_rows(ops)
        assert found is not None
        result = plan_small(found, local, remote, access, device_ok=False, slice_bytes=SLICE)
        return None if result is None else _flat(*result)

    fast = _outcome(small)
    if fast is None:  # more than a slice: the general path takes it
        assert int(ops["length"].sum()) > SLICE
        return
    slow = _outcome(general)
    if isinstance(slow, tuple) and isinstance(slow[0], type):
        assert isinstance(fast, tuple) and fast[0] is slow[0]  # the same kind of refusal
    else:
        assert fast == slow


def _flat(regions: list[Region], frames: list[FramePlan]) -> tuple[list[int], bytes, list[bytes]]:
    """What goes on the wire, ops one per descriptor (the general plan merges neighbours:
    split its descriptors back at the same boundaries by comparing bytes moved)."""
    descriptors = np.concatenate([f.descriptors for f in frames])
    views = [bytes(v) for f in frames for v in f.views]
    spans = [
        (int(d["region"]), int(d["key"]), int(d["offset"]), int(d["length"])) for d in descriptors
    ]
    return [r.id for r in regions], repr(_bytes_moved(spans)).encode(), [b"".join(views)]


def _bytes_moved(spans: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int]]:
    """Each remote byte range, merged where one continues the previous."""
    merged: list[tuple[int, int, int]] = []
    for region, key, offset, length in spans:
        if merged and merged[-1][0] == region and merged[-1][1] + merged[-1][2] == offset:
            merged[-1] = (region, merged[-1][1], merged[-1][2] + length)
        else:
            merged.append((region, offset, length))
        assert key != 0
    return merged


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 4),
            st.booleans(),  # a wrong key
            st.integers(0, 70_000),
            st.integers(1, 9_000),
        ),
        min_size=1,
        max_size=SMALL_OPS,
    ),
    st.sampled_from(["r", "w"]),
)
def test_small_frames_are_refused_as_large_ones(rows: list[tuple[int, ...]], access: str) -> None:
    """The responder's check of a few ops (plain integers) and of many (numpy) agree: a
    batch of up to SMALL_OPS ops, and the same ops padded past it with harmless ones."""
    table = RegionTable()
    table.register(bytearray(SIZES[0]), "rw")
    table.register(bytes(SIZES[1]), "rw")  # read-only memory
    table.register(bytearray(SIZES[2]), "r")
    keys = {r.id: r.key for r in table.infos()}
    descriptors = np.zeros(len(rows), DESCRIPTOR)
    for i, (region, wrong, offset, length) in enumerate(rows):
        descriptors[i] = (region, 0, keys.get(region, 0) ^ int(wrong), offset, length)
    padding = np.zeros(SMALL_OPS + 1, DESCRIPTOR)
    padding[:] = (1, 0, keys[1], 0, 1)
    caller = Caller(1, "test")

    def outcome(ops: np.ndarray) -> object:
        try:
            views, use = table.resolve(ops, access, caller)
        except AccessDenied as exc:
            return exc.op_index, str(exc)
        table.finish(use)
        return [bytes(v) for v in views[: len(rows)]]

    small = outcome(descriptors)
    large = outcome(np.concatenate([descriptors, padding]))
    assert small == large


def test_a_list_of_tuples_takes_the_fast_path_too() -> None:
    local, remote = _tables()
    rows = small_rows([(1, 0, 1, 0, 100), (3, 10, 1, 200, 50)])
    assert rows is not None
    planned = plan_small(rows, local, remote, "w", device_ok=False, slice_bytes=SLICE)
    assert planned is not None
    regions, frames = planned
    assert [r.id for r in regions] == [1, 3] and len(frames) == 1
    assert frames[0].nbytes == 150 and list(frames[0].descriptors["offset"]) == [0, 200]
    assert small_rows(np.zeros(SMALL_OPS + 1, OP_DTYPE)) is None
    with pytest.raises(LocalProtocolError):
        small_rows([(1, -1, 1, 0, 100)])
