"""A namespace's lease ledger (``store/server/_ledger.py``), transition by transition, on a
real store and a fake clock: who may write or read which slot, when slots and pins come
back, and that a read pins its blocks once."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from helpers import FakeClock, keys, payloads

from kvbridge.store import BadRequest, BlockPinned, LeaseExpired, StoreFull, TieredStore
from kvbridge.store.server import LeaseCounts, Leases

BB = 4096
TTL = 10.0
A, B = 5, 6  # two sessions


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock: FakeClock) -> Iterator[TieredStore]:
    with TieredStore(BB, host_capacity=4 * BB, clock=clock) as store:
        yield store


@pytest.fixture
def leases(store: TieredStore) -> Leases:
    return Leases(store, LeaseCounts(per_session=64), blocks=4)


def _slots(*slots: int) -> tuple[np.ndarray, np.ndarray]:
    return np.array(slots), np.array(slots)


def _stage(leases: Leases, session: int, first: int, last: int) -> tuple[int, list[int]]:
    lease, slots = leases.stage(session, "", keys(first, last), TTL, protect=set())
    assert all(slot is not None for slot in slots)
    return lease, [slot for slot in slots if slot is not None]


def test_only_the_staging_session_may_write_its_open_slots(leases: Leases) -> None:
    lease, slots = _stage(leases, A, 0, 2)
    assert slots == [0, 1]
    first, last = np.array([0, 1, 0, 2, 0, 5]), np.array([0, 1, 1, 2, 2, 5])
    allowed, held = leases.admit(A, "w", first, last)
    assert allowed.tolist() == [True, True, True, False, False, False]
    assert held == [] and leases.in_flight(lease) == 0  # a refused range: nothing counted
    assert not leases.admit(B, "w", first[:3], last[:3])[0].any()  # another session
    assert not leases.admit(A, "r", first[:3], last[:3])[0].any()  # staged is not readable
    assert leases.admit(A, "w", first[:3], last[:3])[1] == [lease]
    leases.done([lease])
    leases.commit(A, lease, handoff_ttl=0, share=1.0)
    assert not leases.admit(A, "w", first[:3], last[:3])[0].any()  # committed: over


@pytest.mark.parametrize("ending", ["abort", "session", "deadline"])
def test_an_ended_staging_keeps_its_slots_until_its_admitted_writes_are_done(
    leases: Leases, clock: FakeClock, ending: str
) -> None:
    """A late write (its lease ended while its bytes arrive) never lands in a slot handed
    to someone else: the slots come back only after it."""
    lease, slots = _stage(leases, A, 0, 2)
    _, admitted = leases.admit(A, "w", *_slots(*slots))
    assert admitted == [lease]
    if ending == "abort":
        leases.abort(A, lease)
    elif ending == "session":
        leases.end_session(A)
    else:
        clock.advance(TTL)
        leases.sweep()
    assert not leases.admit(A, "w", *_slots(0))[0].any()  # no more writes admitted
    _, other = _stage(leases, B, 2, 4)
    assert set(other).isdisjoint(slots)  # the slots being written are not handed out
    with pytest.raises(StoreFull):
        _stage(leases, B, 4, 6)
    assert leases.held[A] == 2  # still A's
    leases.done(admitted)  # the late bytes are in: now the slots come back
    assert leases.held[A] == 0 and len(leases) == 1
    assert sorted(_stage(leases, B, 4, 6)[1]) == sorted(slots)


def test_a_commit_waits_for_its_writes_and_a_late_one_stores_nothing(
    leases: Leases, store: TieredStore, clock: FakeClock
) -> None:
    lease, slots = _stage(leases, A, 0, 2)
    _, admitted = leases.admit(A, "w", *_slots(*slots))
    with pytest.raises(BadRequest):
        leases.commit(A, lease, handoff_ttl=0, share=1.0)  # bytes still on their way
    leases.done(admitted)
    with pytest.raises(LeaseExpired):
        leases.commit(B, lease, handoff_ttl=0, share=1.0)  # not B's
    assert leases.commit(A, lease, handoff_ttl=0, share=1.0) == 2
    late, _ = _stage(leases, A, 2, 4)
    clock.advance(TTL)
    with pytest.raises(LeaseExpired):
        leases.commit(A, late, handoff_ttl=0, share=1.0)
    assert store.contains(keys(0, 4)) == [True, True, False, False]
    assert len(leases) == 0 and not leases.held


def test_a_read_pins_its_blocks_once_until_its_last_frame_is_done(
    leases: Leases, store: TieredStore
) -> None:
    ks = keys(0, 2)
    store.put(ks, payloads(ks, BB))
    lease, slots = leases.pin(A, "", ks, TTL)
    assert store.placement.pins.open_leases == 1
    assert not leases.admit(B, "r", *_slots(*slots))[0].any()  # another session
    allowed, admitted = leases.admit(A, "r", *_slots(*slots, *slots))  # a page per layer
    assert allowed.all() and admitted == [lease]
    assert store.placement.pins.open_leases == 1  # the frame added no pin
    leases.release(A, lease)
    with pytest.raises(BlockPinned):
        store.remove(ks)  # still being read
    leases.done(admitted)
    assert store.placement.pins.open_leases == 0
    assert store.remove(ks) == [True, True]


def test_a_read_lease_past_its_deadline_reads_nothing_and_its_release_says_so(
    leases: Leases, store: TieredStore, clock: FakeClock
) -> None:
    ks = keys(0, 2)
    store.put(ks, payloads(ks, BB))
    lease, slots = leases.pin(A, "", ks, TTL)
    clock.advance(TTL)
    assert not leases.admit(A, "r", *_slots(*slots))[0].any()  # before any sweep
    with pytest.raises(LeaseExpired):
        leases.release(A, lease)
    assert len(leases) == 0 and store.placement.pins.open_leases == 0


def test_a_sessions_end_ends_its_leases_only(leases: Leases, store: TieredStore) -> None:
    ks = keys(0, 2)
    store.put(ks, payloads(ks, BB))
    mine, _ = leases.pin(A, "", ks[:1], TTL)
    theirs, _ = leases.pin(B, "", ks[1:], TTL)
    staged, _ = _stage(leases, A, 2, 3)
    leases.end_session(A)
    assert len(leases) == 1 and leases.held == {B: 1}
    with pytest.raises(LeaseExpired):
        leases.release(A, mine)
    with pytest.raises(LeaseExpired):
        leases.commit(A, staged, handoff_ttl=0, share=1.0)
    leases.release(B, theirs)
    assert store.placement.pins.open_leases == 0 and store.contains(keys(2, 3)) == [False]


class _TickingClock(FakeClock):
    """A clock that also moves by ``step`` each time it is read (time passing inside a
    call, as on a loaded machine)."""

    step = 0.0

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_a_handoff_hold_ending_never_takes_a_readers_pin() -> None:
    """A block a reader has pinned gets a handoff hold again (a second writer of it
    commits); the hold ends (a remove, another reader) just before the deadline its record
    says, which is just after its pin's deadline in the store (the record read the clock
    a moment after the store did). The store then unpins "the pin that expires first" on
    the block: the reader's, its only one while its lease is open. Its block was evicted
    for another session's staging, and the reader's lease still admitted reads of that
    slot: the other session's bytes. Found by an attack on 20883bf (a read pins once)."""
    clock = _TickingClock()
    with TieredStore(BB, host_capacity=4 * BB, clock=clock) as store:
        leases = Leases(store, LeaseCounts(per_session=64), blocks=4)
        block = keys(0, 1)
        first, _ = leases.stage(A, "", block, TTL, protect=set())
        second, _ = leases.stage(B, "", block, TTL, protect=set())  # two writers of one new block
        leases.commit(A, first, handoff_ttl=1.0, share=1.0)
        reader, slots = leases.pin(7, "", block, TTL)  # its first read: the hold goes
        clock.step = 0.01  # time moves while the second commit holds the block again
        leases.commit(B, second, handoff_ttl=1.0, share=1.0)
        clock.step = 0.0
        hold = leases.holds.get(block[0])
        assert hold is not None
        # half a tick before the record's deadline: past the store pin's, had the record
        # read the clock again after the pin (a tick later), so its pin gone, its record not
        clock.now = hold.deadline - 0.005
        leases.holds.take(block)  # what a remove, or another reader's pin, does first
        assert leases.in_flight(reader) == 0 and len(leases) == 1  # the lease is open
        assert store.placement.pins.is_pinned(block[0])  # so its block stays pinned
        with pytest.raises(StoreFull):  # every slot but the reader's is free: not enough
            leases.stage(8, "", keys(10, 14), TTL, protect=set())
        assert leases.admit(7, "r", *_slots(*slots))[0].all()  # it reads its own block
