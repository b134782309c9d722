"""The scheduler and worker sides of the vLLM connector on scripted vLLM calls (no engine):
the cases a real run rarely reaches on a CPU build (async scheduling's steps in flight)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import FakeClock, until

from kvbridge.bindings.core._jobs import SaveJob
from kvbridge.bindings.vllm._groups import Group, KVGroups
from kvbridge.bindings.vllm._meta import StepMeta, Transfer
from kvbridge.bindings.vllm._scheduler import SchedulerSide
from kvbridge.bindings.vllm._worker import WorkerSide
from kvbridge.store import BlockKey, Lease


class _Core:
    """What the sides use of a ConnectorCore: every load fails, saves are recorded."""

    block_tokens = 32
    config = SimpleNamespace(pd_wait=10.0, lookup_wait=0.05)
    identity = SimpleNamespace(dtype="float32")

    def __init__(self) -> None:
        self.saved: list[SaveJob] = []
        self.pins: list[Lease] = []
        self.unpinned: list[Lease] = []
        self.lookups = 0
        self.mirror: int | None = None
        """What the store's mirror says (``None``: no mirror in step)."""
        self.stats = SimpleNamespace(late=0)
        self.stats.lookup_late = lambda: setattr(self.stats, "late", self.stats.late + 1)
        self.declined: list[int] = []
        self.stats.declined = self.declined.append

    def keys(self, tokens: list[int], extra: bytes = b"") -> list[bytes]:
        return [bytes([i]) * 32 for i in range(len(tokens) // 32)]

    def lookup(self, keys: list[bytes]) -> int:
        self.lookups += 1
        return len(keys)

    def mirrored(self, keys: list[bytes]) -> int | None:
        return self.mirror

    def pin(self, keys: list[bytes], start: int = 0) -> Lease:
        self.pins.append(Lease(lambda _: None, time.monotonic, len(self.pins) + 1, (), math.inf))
        return self.pins[-1]

    def unpin(self, hold: Lease | None) -> None:
        if hold is not None:
            self.unpinned.append(hold)

    def mark(self) -> object | None:
        return None

    def load(self, keys: Any, block_ids: Any, start: int = 0, after: object = None) -> bool:
        return False

    def load_leading(
        self, keys: Any, block_ids: Any, start: int = 0, *, partial: bool = True, **_: object
    ) -> int:
        return 0  # not even the first block

    def save_later(self, jobs: list[SaveJob]) -> None:
        self.saved += jobs

    def saving(self, request: str) -> bool:
        return False


ONE_GROUP = KVGroups((Group(0, "full", 0, ("layer",)),))
"""A model of one full-attention KV cache group (keys as they were before groups)."""


def _save(request: str) -> StepMeta:
    return StepMeta(saves=[Transfer(request, (BlockKey(b"k" * 32),), (1,))])


def test_a_failed_load_drops_the_saves_of_every_step_in_flight() -> None:
    core = _Core()
    worker = WorkerSide(core, steps_in_flight=2)  # type: ignore[arg-type]
    worker.load(StepMeta(loads=[Transfer("a", (BlockKey(b"x" * 32),), (3,))]))
    worker.save(_save("a"))  # the failing step
    worker.load_errors()  # vLLM's order under speculative decoding: errors before saves
    worker.save(_save("b"))  # planned before vLLM learned of the failure
    worker.save(_save("c"))  # planned after: saved
    assert [job.request for job in core.saved] == ["c"]
    report = worker.report()
    assert report is not None and report.unsaved == {"a", "b"}


def _request(req_id: str, tokens: int, **more: Any) -> Any:
    fields = {
        "request_id": req_id,
        "prompt_token_ids": list(range(tokens)),
        "num_tokens": tokens,
        "mm_features": [],
        "kv_transfer_params": None,
        "prompt_embeds": None,
    }
    return SimpleNamespace(**{**fields, **more})


def _output(new: list[Any]) -> Any:
    cached = SimpleNamespace(
        req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
    )
    return SimpleNamespace(
        preempted_req_ids=set(),
        scheduled_new_reqs=new,
        num_scheduled_tokens={n.req_id: 1 for n in new},
        scheduled_cached_reqs=cached,
    )


def _answer(side: SchedulerSide, request: Any, computed: int = 0) -> tuple[int | None, bool]:
    """What vLLM's scheduler gets once the lookup settled: it asks every step."""
    answers: list[tuple[int | None, bool]] = []

    def answered() -> bool:
        answers.append(side.matched(request, computed))
        return answers[-1][0] is not None

    until(answered, "the lookup settled")
    return answers[-1]


@contextmanager
def _side(core: Any, **more: Any) -> Iterator[SchedulerSide]:
    side = SchedulerSide(core, ONE_GROUP, **{"loads": True, "saves": False, **more})
    try:
        yield side
    finally:
        side.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_a_loads_pin_lasts_until_every_step_in_flight_ran(clock: FakeClock) -> None:
    core = _Core()
    with _side(core, steps_in_flight=2, clock=clock) as side:
        request = _request("r", 100)
        assert side.matched(request, 0) == (None, False)  # asked on the connector's thread
        assert _answer(side, request) == (96, False)  # 3 full blocks; tokens 96-99 computed
        side.allocated(request, None, 96)
        new = SimpleNamespace(req_id="r", block_ids=([7, 8, 9, 10],), num_computed_tokens=96)
        meta = side.build(_output([new]))
        assert [t.block_ids for t in meta.loads] == [(7, 8, 9)]
        side.build(_output([]))  # async scheduling: the load's step may not have run yet
        until(lambda: len(core.pins) == 1)
        side.build(_output([]))
    assert core.unpinned == core.pins  # released in order, on the connector's thread


def test_a_hit_vllm_does_not_take_is_counted_as_declined(clock: FakeClock) -> None:
    """Advertised, not delivered, and not a failure: vLLM gave the request fewer tokens to
    load than it was offered (``tokens_lost_declined``)."""
    core = _Core()
    with _side(core, clock=clock) as side:
        taken, declined = _request("taken", 100), _request("declined", 100)
        for request in (taken, declined):
            side.matched(request, 0)
            assert _answer(side, request) == (96, False)
        side.allocated(taken, None, 96)
        side.allocated(declined, None, 0)
    assert core.declined == [96]


class _FrozenCore(_Core):
    """A store that stopped answering: every call waits until ``thaw`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.thaw = threading.Event()
        self.asked = threading.Event()

    def lookup(self, keys: list[bytes]) -> int:
        self.asked.set()
        self.thaw.wait()
        return len(keys)

    def unpin(self, hold: Lease | None) -> None:
        self.thaw.wait()
        super().unpin(hold)


def test_a_store_that_stops_answering_never_holds_the_scheduler(clock: FakeClock) -> None:
    """Every scheduler-side call returns while the store answers nothing; a lookup later
    than ``lookup_wait`` is a miss, and the pin its late answer took is released."""
    core = _FrozenCore()
    with _side(core, saves=True, clock=clock) as side:
        done = threading.Event()

        def schedule() -> None:
            request = _request("r", 100)
            assert side.matched(request, 0) == (None, False)
            until(core.asked.is_set, "the lookup thread asked the store")
            clock.advance(0.01)
            assert side.matched(request, 0) == (None, False)  # within lookup_wait: ask again
            clock.advance(0.05)
            assert side.matched(request, 0) == (0, False)  # late: compute the prefix
            side.allocated(request, None, 0)
            new = SimpleNamespace(req_id="r", block_ids=([1, 2, 3, 4],), num_computed_tokens=0)
            side.build(_output([new]))
            assert side.finished(request)[0] is False
            done.set()

        thread = threading.Thread(target=schedule)
        thread.start()
        thread.join(10)
        assert done.is_set()  # nothing above waited for the store
        assert core.stats.late == 1
        core.thaw.set()  # the store answers the late lookup: its pin is released
    assert len(core.pins) == 1 and core.unpinned == core.pins


def test_a_request_that_ends_while_its_lookup_runs_releases_its_pin(clock: FakeClock) -> None:
    core = _FrozenCore()
    with _side(core, clock=clock) as side:
        request = _request("r", 100)
        assert side.matched(request, 0) == (None, False)
        until(core.asked.is_set)
        side.finished(request)  # aborted before vLLM asked again
        core.thaw.set()
    assert len(core.pins) == 1 and core.unpinned == core.pins


def test_a_mirror_answers_misses_at_once_and_hits_with_a_pin_alone(clock: FakeClock) -> None:
    core = _Core()
    with _side(core, clock=clock) as side:
        core.mirror = 0
        assert side.matched(_request("miss", 100), 0) == (0, False)  # no step lost
        core.mirror = 2
        assert side.matched(_request("hit", 100), 0) == (None, False)
        assert _answer(side, _request("hit", 100)) == (64, False)
        assert core.lookups == 0 and len(core.pins) == 1  # the pin checked it; no lookup


def test_an_answer_for_another_local_hit_is_asked_again(clock: FakeClock) -> None:
    """vLLM's own prefix hit moved while the lookup ran (a request beside it filled vLLM's
    cache): the answer was for the old one, so it is released and asked again (loading it
    would put blocks in the wrong places)."""
    core = _Core()
    with _side(core, clock=clock) as side:
        request = _request("r", 100)
        assert side.matched(request, 0) == (None, False)
        until(lambda: len(core.pins) == 1, "the first lookup pinned blocks 0-2")
        assert side.matched(request, 32) == (None, False)  # vLLM holds block 0 now
        assert core.unpinned == core.pins[:1] or _released(core, 1)
        assert _answer(side, request, 32) == (64, False)  # blocks 1-2, asked for anew
        side.finished(request)
    assert core.unpinned == core.pins and len(core.pins) == 2


def _released(core: _Core, count: int) -> bool:
    until(lambda: len(core.unpinned) >= count, "the stale pin is released")
    return True


def test_vllms_own_blocks_cover_the_hit_no_store_call(clock: FakeClock) -> None:
    core = _FrozenCore()
    with _side(core, clock=clock) as side:
        assert side.matched(_request("r", 100), 96) == (0, False)  # nothing past vLLM's own
        assert not core.asked.is_set()
        core.thaw.set()


def test_requests_whose_kv_token_ids_do_not_decide_are_left_alone() -> None:
    with _side(_Core(), saves=True) as side:
        embeds = _request("e", 100, prompt_embeds=object())
        media = _request("m", 100, mm_features=[object()])
        assert side.matched(embeds, 0) == (0, False) and side.matched(media, 0) == (0, False)
        assert side.finished(embeds) == (False, None)


class _KeyCore(_Core):
    """Records what besides the tokens each request's keys were made from."""

    def __init__(self) -> None:
        super().__init__()
        self.extras: dict[bytes, bytes] = {}

    def keys(self, tokens: list[int], extra: bytes = b"") -> list[bytes]:
        keys = [bytes([i]) * 31 + extra[:1] for i in range(len(tokens) // 32)]
        self.extras[bytes(tokens[:1])] = extra
        return keys


def _adapter_folder(folder: Any, weights: bytes) -> str:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text('{"r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return str(folder)


def test_lora_adapters_are_keyed_by_their_files_not_their_names(tmp_path: Any) -> None:
    core = _KeyCore()
    one = _adapter_folder(tmp_path / "one", b"\x01" * 4096)
    other = _adapter_folder(tmp_path / "other", b"\x02" * 4096)
    copy = _adapter_folder(tmp_path / "elsewhere" / "one", b"\x01" * 4096)
    seen = []
    with _side(core, saves=True) as side:
        for n, (name, path) in enumerate([("chat", one), ("chat", other), ("tuned", copy)]):
            lora = SimpleNamespace(lora_name=name, lora_int_id=n + 1, lora_path=path)
            request = _request(f"r{n}", 64, lora_request=lora)
            request.prompt_token_ids = [n, *range(1, 64)]
            side.matched(request, 0)
            seen.append(core.extras[bytes([n])])
    assert seen[0] != seen[1]  # one name, two adapters: never each other's KV
    assert seen[0] == seen[2]  # a copy of the same files under another name shares it
    assert b"chat" not in seen[0] and b"tuned" not in seen[2]
