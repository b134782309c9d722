"""The region table: what a remote op must pass before a byte moves, and its locking."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvbridge.transfer import Admission, Caller, RegionBusy
from kvbridge.transfer._errors import AccessDenied
from kvbridge.transfer._protocol import DESCRIPTOR
from kvbridge.transfer._regions import Region, RegionTable

ME = Caller(session=7, peer="client")


def _ops(region: Region, *spans: tuple[int, int]) -> np.ndarray:
    ops = np.zeros(len(spans), dtype=DESCRIPTOR)
    ops["region"], ops["key"] = region.id, region.key
    ops["offset"] = [offset for offset, _ in spans]
    ops["length"] = [length for _, length in spans]
    return ops


def test_resolve_returns_views_and_holds_the_region_until_released() -> None:
    table = RegionTable()
    buffer = bytearray(range(64))
    region = table.register(buffer, "rw")
    views, used = table.resolve(_ops(region, (8, 4), (60, 4)), "w", ME)
    assert [bytes(v) for v in views] == [bytes([8, 9, 10, 11]), bytes([60, 61, 62, 63])]
    with pytest.raises(RegionBusy):
        table.unregister(region)
    table.finish(used)
    table.unregister(region)


def test_ops_that_continue_one_another_share_a_view_only_when_asked() -> None:
    """Pages of one block in order are one view for a byte-stream pipe (the bytes land in
    the same places); a gap, a step back or another region starts a new view."""
    table = RegionTable()
    one, two = table.register(bytearray(range(256)), "rw"), table.register(bytearray(64), "rw")
    pages = [(i * 8, 8) for i in range(10)]  # 0..80 in one run
    ops = np.concatenate(
        [_ops(one, *pages), _ops(one, (96, 8), (104, 8), (0, 8)), _ops(two, (8, 8))]
    )
    views, used = table.resolve(ops, "w", ME, merge=True)
    assert [(v.obj is one.view.obj, len(v)) for v in views] == [
        (True, 80),
        (True, 16),
        (True, 8),
        (False, 8),
    ]
    assert bytes(views[0]) == bytes(range(80)) and bytes(views[1]) == bytes(range(96, 112))
    table.finish(used)
    views, used = table.resolve(ops, "w", ME)
    assert [len(v) for v in views] == [8] * len(ops)
    table.finish(used)


@pytest.mark.parametrize(
    ("spans", "access", "reason"),
    [
        (((0, 4), (62, 4)), "w", "op 1: bytes outside region"),
        (((0, 4),), "x", "does not allow 'x'"),
        (((0, 4), (16, 4), (32, 4)), "w", "op 1: region 1 refuses"),
    ],
)
def test_a_refused_batch_names_its_first_bad_op_and_holds_nothing(
    spans: tuple[tuple[int, int], ...], access: str, reason: str
) -> None:
    table = RegionTable()

    def guard(caller: Caller, access: str, offsets: np.ndarray, lengths: np.ndarray) -> Admission:
        return Admission(np.asarray(offsets != 16))

    region = table.register(bytearray(64), "rw", guard=guard)
    with pytest.raises(AccessDenied, match=reason):
        table.resolve(_ops(region, *spans), access, ME)
    table.unregister(region)  # nothing was left acquired


def test_a_guard_sees_the_caller_and_its_hold_lasts_until_finish() -> None:
    """The guard learns the authenticated session; what it holds is released by finish(),
    and when a second region refuses, the first region's hold is released at once."""
    table = RegionTable()
    seen: list[Caller] = []
    held: list[str] = []

    def holding(caller: Caller, access: str, offsets: np.ndarray, lengths: np.ndarray) -> Admission:
        seen.append(caller)
        held.append("a")
        return Admission(np.ones(len(offsets), dtype=bool), lambda: held.remove("a"))

    def refusing(
        caller: Caller, access: str, offsets: np.ndarray, lengths: np.ndarray
    ) -> Admission:
        return Admission(np.zeros(len(offsets), dtype=bool))

    first = table.register(bytearray(64), "rw", guard=holding)
    second = table.register(bytearray(64), "rw", guard=refusing)
    _, used = table.resolve(_ops(first, (0, 4)), "w", ME)
    assert seen == [ME] and held == ["a"]
    table.finish(used)
    assert held == []
    both = np.concatenate([_ops(first, (0, 4)), _ops(second, (0, 4))])
    with pytest.raises(AccessDenied, match="op 1"):
        table.resolve(both, "w", ME)
    assert held == []  # the first region's hold went with the refusal
    table.unregister(first)
    table.unregister(second)


def test_a_region_no_peer_may_touch() -> None:
    """access="none": not listed in the metadata, and every remote op is refused."""
    table = RegionTable()
    region = table.register(bytearray(64), "none")
    assert table.infos() == []
    for access in ("r", "w"):
        with pytest.raises(AccessDenied, match="does not allow"):
            table.resolve(_ops(region, (0, 4)), access, ME)
    table.unregister(region)


def test_a_wrong_key_is_refused() -> None:
    table = RegionTable()
    region = table.register(bytearray(64), "rw")
    ops = _ops(region, (0, 4))
    ops["key"] ^= 1
    with pytest.raises(AccessDenied, match="wrong access key"):
        table.resolve(ops, "r", ME)


def test_a_guard_may_use_the_table_while_it_checks() -> None:
    """Guards run outside the table's lock: one that looks at the table does not hang."""
    table = RegionTable()

    def guard(caller: Caller, access: str, offsets: np.ndarray, lengths: np.ndarray) -> Admission:
        table.infos()
        return Admission(np.ones(len(offsets), dtype=bool))

    region = table.register(bytearray(64), "rw", guard=guard)
    done = threading.Event()

    def resolve() -> None:
        _, used = table.resolve(_ops(region, (0, 4)), "w", ME)
        table.finish(used)
        done.set()

    worker = threading.Thread(target=resolve, daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert done.is_set()
