"""A store's change feed (``TieredStore.watch``): a mirror built from nothing but the reports
holds exactly the store's keys after every operation, whatever the operations did on the
way (evictions through every tier, demotions to disk, promotions, removals, clears with
pinned blocks), and knows the tier each key is in."""

from __future__ import annotations

import tempfile

from helpers import key, payloads
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.store import BlockKey, BlockNotFound, BlockPinned, StoreFull, TieredStore

BB = 64
KEYS = [key(i) for i in range(30)]
ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "get", "remove", "clear", "pin", "unpin"]),
        st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=6, unique=True),
    ),
    max_size=40,
)


class _Mirror:
    def __init__(self) -> None:
        self.where: dict[bytes, str] = {}
        self.reports = 0

    def __call__(self, changes: list[tuple[BlockKey, str | None]]) -> None:
        self.reports += 1
        for k, tier in changes:
            if tier is None:
                self.where.pop(k, None)
            else:
                self.where[k] = tier


def _run(store: TieredStore, op: str, ks: list[bytes], pinned: set[bytes]) -> None:
    try:
        if op == "put":
            store.put(ks, payloads(ks, BB))
        elif op == "get":
            store.get(ks, payloads(ks, BB))
        elif op == "remove":
            store.remove(ks)
        elif op == "clear":
            store.clear()
        elif op == "pin":
            store.pin(ks)
            pinned.update(ks)
        elif op == "unpin":
            held = [k for k in ks if k in pinned]
            store.unpin(held)
            pinned.difference_update(held)
    except (BlockNotFound, BlockPinned, StoreFull):
        pass  # refused: the feed must still agree with what the store holds


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.booleans())
def test_a_mirror_fed_by_the_reports_holds_what_the_store_holds(
    sequence: list[tuple[str, list[int]]], with_disk: bool
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        disk = {"disk_path": tmp, "disk_capacity": 8 * BB} if with_disk else {}
        with TieredStore(BB, host_capacity=5 * BB, **disk) as store:  # type: ignore[arg-type]
            mirror = _Mirror()
            store.watch(mirror)
            pinned: set[bytes] = set()
            for op, ids in sequence:
                _run(store, op, [KEYS[i] for i in ids], pinned)
                present = {k for k, there in zip(KEYS, store.contains(KEYS), strict=True) if there}
                assert set(mirror.where) == present, op
                for k, tier in mirror.where.items():
                    assert tier == _highest_tier(store, k)


def _highest_tier(store: TieredStore, k: bytes) -> str:
    return next(tier.name for tier in store.tiers if k in tier)


def test_one_report_per_operation_and_none_once_unwatched() -> None:
    with TieredStore(BB, host_capacity=8 * BB) as store:
        mirror = _Mirror()
        store.watch(mirror)
        store.put(KEYS[:4], payloads(KEYS[:4], BB))
        store.match_prefix(KEYS[:4])  # reads change nothing: nothing to report
        assert mirror.reports == 1 and set(mirror.where) == set(KEYS[:4])
        store.watch(None)
        store.remove(KEYS[:2])
        assert mirror.reports == 1
