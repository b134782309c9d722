"""Random operation sequences against a plain dict: the bytes always match the model.

Exercises merged copies (adjacent and scattered slots, flat and per-block buffers),
eviction through every tier and promotion, with Hypothesis choosing the operations.
"""

from __future__ import annotations

import tempfile

import numpy as np
from helpers import key, payload, payloads
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbridge.store import BlockNotFound, StoreFull, TieredStore

BB = 64
ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "put_list", "get", "get_list", "remove"]),
        st.lists(st.integers(0, 30), min_size=1, max_size=6, unique=True),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops, st.sampled_from(["lru", "fifo"]), st.booleans())
def test_store_matches_a_dict(
    sequence: list[tuple[str, list[int]]], policy: str, with_disk: bool
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        disk = {"disk_path": tmp, "disk_capacity": 6 * BB} if with_disk else {}
        with TieredStore(BB, host_capacity=5 * BB, policy=policy, **disk) as store:  # type: ignore[arg-type]
            for op, ids in sequence:
                ks = [key(i) for i in ids]
                if op in ("put", "put_list"):
                    blocks = (
                        payloads(ks, BB) if op == "put" else [payload(k, BB).tobytes() for k in ks]
                    )
                    before = store.contains(ks)
                    try:
                        store.put(ks, blocks)
                    except StoreFull:  # more blocks than all tiers hold: nothing stored
                        assert len(ks) > 5 + (6 if with_disk else 0)
                        assert store.contains(ks) == before
                        continue
                    assert all(store.contains(ks))  # a put keeps every one of its blocks
                elif op == "remove":
                    store.remove(ks)
                else:
                    present = store.contains(ks)
                    out = np.zeros((len(ks), BB), np.uint8)
                    target = out if op == "get" else list(out)
                    try:
                        store.get(ks, target)
                    except BlockNotFound as exc:
                        assert not all(present)
                        assert set(exc.keys) == {
                            k for k, p in zip(ks, present, strict=True) if not p
                        }
                        assert not out.any()
                        continue
                    assert all(present)
                    np.testing.assert_array_equal(out, payloads(ks, BB))
                stats = store.stats()
                assert all(t.blocks <= t.capacity_blocks for t in stats.tiers)
