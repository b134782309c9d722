"""The scheduler and worker sides of the vLLM connector on scripted vLLM calls (no engine):
the cases a real run rarely reaches on a CPU build (async scheduling's steps in flight)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvbridge.bindings._jobs import SaveJob
from kvbridge.bindings._vllm_meta import StepMeta, Transfer
from kvbridge.bindings._vllm_scheduler import SchedulerSide
from kvbridge.bindings._vllm_worker import WorkerSide
from kvbridge.store import BlockKey


class _Core:
    """What the sides use of a ConnectorCore: every load fails, saves are recorded."""

    block_tokens = 32
    config = SimpleNamespace(pd_wait=10.0)
    identity = SimpleNamespace(dtype="float32")

    def __init__(self) -> None:
        self.saved: list[SaveJob] = []
        self.pins: list[object] = []
        self.unpinned: list[object] = []

    def keys(self, tokens: list[int], extra: bytes = b"") -> list[bytes]:
        return [bytes([i]) * 32 for i in range(len(tokens) // 32)]

    def lookup(self, keys: list[bytes]) -> int:
        return len(keys)

    def pin(self, keys: list[bytes]) -> object:
        self.pins.append(object())
        return self.pins[-1]

    def unpin(self, hold: object | None) -> None:
        if hold is not None:
            self.unpinned.append(hold)

    def load(self, keys: Any, block_ids: Any) -> bool:
        return False

    def save_later(self, jobs: list[SaveJob]) -> None:
        self.saved += jobs

    def saving(self, request: str) -> bool:
        return False


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


def test_a_loads_pin_lasts_until_every_step_in_flight_ran() -> None:
    core = _Core()
    side = SchedulerSide(core, loads=True, saves=False, steps_in_flight=2)  # type: ignore[arg-type]
    request = _request("r", 100)
    assert side.matched(request, 0) == (96, False)  # 3 full blocks; tokens 96-99 computed
    side.allocated(request, None, 96)
    new = SimpleNamespace(req_id="r", block_ids=([7, 8, 9, 10],), num_computed_tokens=96)
    meta = side.build(_output([new]))
    assert [t.block_ids for t in meta.loads] == [(7, 8, 9)]
    side.build(_output([]))  # async scheduling: the load's step may not have run yet
    assert core.unpinned == []
    side.build(_output([]))
    assert core.unpinned == core.pins


def test_requests_whose_kv_token_ids_do_not_decide_are_left_alone() -> None:
    side = SchedulerSide(_Core(), loads=True, saves=True)  # type: ignore[arg-type]
    embeds = _request("e", 100, prompt_embeds=object())
    media = _request("m", 100, mm_features=[object()])
    assert side.matched(embeds, 0) == (0, False) and side.matched(media, 0) == (0, False)
    assert side.finished(embeds) == (False, None)
