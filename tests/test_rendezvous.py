"""Rendezvous hashing: even spread, about 1/N of the keys move when a member joins or
leaves (and only those), replicas on distinct members, the same answer in every process."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence

import numpy as np
import pytest

from kvbridge.store import prefix_hashes
from kvbridge.store.cluster._rendezvous import Rendezvous

KEYS = prefix_hashes(range(30_000 * 4), 4, algo="xxh3_128")
SEQUENTIAL = [i.to_bytes(32, "big") for i in range(30_000)]  # keys that differ in a few bits
NODES = ["10.0.0.1:7000", "10.0.0.2:7000", "10.0.0.3:7000"]


def _owner(ring: Rendezvous, keys: Sequence[bytes]) -> list[str]:
    return [ring.members[i] for i in ring.owners(keys)[:, 0]]


@pytest.mark.parametrize("keys", [KEYS, SEQUENTIAL], ids=["prefix-hashes", "sequential"])
def test_keys_spread_evenly(keys: list[bytes]) -> None:
    owners = _owner(Rendezvous(NODES), keys)
    counts = [owners.count(node) for node in NODES]
    assert all(abs(c - len(keys) / 3) <= 0.05 * len(keys) / 3 for c in counts), counts


def test_a_join_moves_about_a_quarter_and_only_to_the_new_member() -> None:
    before = _owner(Rendezvous(NODES), KEYS)
    after = _owner(Rendezvous([*NODES, "10.0.0.4:7000"]), KEYS)
    moved = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    assert 0.22 <= len(moved) / len(KEYS) <= 0.28
    assert {b for _, b in moved} == {"10.0.0.4:7000"}  # nothing moves between old members


def test_a_loss_moves_only_the_lost_members_keys() -> None:
    before = _owner(Rendezvous(NODES), KEYS)
    after = _owner(Rendezvous(NODES[:2]), KEYS)
    moved = [a for a, b in zip(before, after, strict=True) if a != b]
    assert set(moved) == {NODES[2]}
    assert len(moved) == before.count(NODES[2])


def test_replicas_are_distinct_and_the_first_is_the_owner() -> None:
    ring = Rendezvous(NODES)
    two = ring.owners(KEYS[:1000], replicas=2)
    assert two.shape == (1000, 2) and (two[:, 0] != two[:, 1]).all()
    assert (two[:, 0] == ring.owners(KEYS[:1000])[:, 0]).all()
    assert ring.owners(KEYS[:10], replicas=5).shape == (10, 3)  # no more than the members
    # A replica is where the key goes when its owner is lost: the read falls back there.
    survivors = Rendezvous([n for n in NODES if n != ring.members[two[0, 0]]])
    assert survivors.owner_names(KEYS[0]) == [ring.members[two[0, 1]]]


def test_member_order_does_not_matter_and_names_must_be_distinct() -> None:
    assert _owner(Rendezvous(NODES), KEYS[:500]) == _owner(Rendezvous(NODES[::-1]), KEYS[:500])
    with pytest.raises(ValueError, match="distinct"):
        Rendezvous([NODES[0], NODES[0]])
    with pytest.raises(ValueError, match="replicas"):
        Rendezvous(NODES).owners(KEYS[:1], replicas=0)
    assert Rendezvous([]).owners(KEYS[:3]).shape == (3, 0)


def test_every_process_computes_the_same_owners() -> None:
    code = (
        "from kvbridge.store.cluster._rendezvous import Rendezvous; import sys; "
        f"print(Rendezvous({NODES!r}).owners([bytes.fromhex(h) for h in sys.argv[1:]])"
        "[:, 0].tolist())"
    )
    sample = KEYS[:50]
    out = subprocess.run(
        [sys.executable, "-c", code, *(k.hex() for k in sample)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == str(Rendezvous(NODES).owners(sample)[:, 0].tolist())
    assert np.array_equal(Rendezvous(NODES).owners(sample), Rendezvous(NODES).owners(sample))
