"""The scheduler side of the vLLM connector: which prefix to load for a request, which
blocks to save each step, and the request's end.

Per request it keeps the keys of its prompt's full blocks, the cached answer of its
lookup (vLLM asks again every step a request waits: the answer must not change and must
cost nothing), the pin that keeps the advertised blocks in the store until they are
loaded, its engine block ids, and how many prompt blocks were queued for saving.

The scheduler never waits on the network: a request's lookup and pin run on the
connector's own thread (:class:`~kvbridge.bindings.core.Lookups`). The first call for a
request starts them and answers ``None`` (vLLM asks again next step); a later call
answers the count once it is known, or 0 (the request computes its prefix) when the
lookup took longer than ``lookup_wait``: its late answer's pin is then released.

Decisions (see ``docs/VLLM.md``): loads are synchronous (before the forward of the step
that computes the rest of the prompt), saves run off the step on a worker thread, blocks
are saved when full and only for the prompt, and a request with multimodal inputs or
prompt embeddings is neither loaded nor saved (its token ids do not say what its KV is).
A hybrid model's KV cache groups (``_groups``) each have their keys and block ids: a hit
is the longest prefix every group holds, a sliding window's group moves only the blocks
vLLM keeps for it, its saves run before the step ends, and its loads are asynchronous.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...store import BlockKey, Lease
from ..core._core import ConnectorCore
from ..core._identity import PROCESS_SALT, weights
from ..core._lookups import Lookup, Lookups
from ._groups import NULL_BLOCK, Group, GroupedKeys, GroupedStore, KVGroups
from ._meta import StepMeta, Transfer, WorkerReport

PD_PARAM = "kvbridge_blocks"
"""The ``kv_transfer_params`` key a prefill instance returns: how many leading prompt
blocks it saved. The decode instance waits (up to ``pd_wait``) until it can load them."""

_RELOOK_S = 0.01
"""While a decode request waits for its prefill's blocks, look again at most this often."""
LOOKUP_THREADS = 4
"""Lookups asked side by side (the scheduler side's store connections): a burst of new
requests is not looked up one round trip after another."""
_YIELD_EVERY_S = 0.001
_REPIN_S = 15.0
"""A request that waits longer for admission looks (and pins) again: its pin is a server
lease (60 s by default) and must still hold when the load runs."""


@dataclass
class _Request:
    keys: GroupedKeys
    """The prompt's full blocks' keys, in every KV cache group."""
    tokens: Sequence[int] = ()
    """The prompt's token ids (vLLM's own list: saves send their blocks' with them)."""
    local: int = 0
    """Tokens vLLM's own prefix cache holds (block-aligned), as of the last lookup."""
    hit: int | None = None
    """Leading blocks the store can give, cached until the request is admitted."""
    hold: Lease | None = None
    asking: Lookup | None = None
    """The lookup in flight on the connector's thread."""
    load: tuple[int, int] | None = None
    """Blocks ``[first, last)`` to load, once vLLM allocated them."""
    block_ids: list[list[int]] = field(default_factory=list)
    """vLLM's block ids, one list per KV cache group."""
    saved: int = 0
    """Leading prompt blocks queued for saving."""
    saves: bool = False
    """A save of this request was sent to the workers (they may still be reading)."""
    expect: int = 0
    wait_until: float = 0.0
    looked_at: float = 0.0
    offered: int = 0
    """Tokens the last answer offered to load (what vLLM may take or decline)."""


class SchedulerSide:
    def __init__(
        self,
        core: ConnectorCore,
        groups: KVGroups,
        *,
        loads: bool,
        saves: bool,
        steps_in_flight: int = 1,
        async_loads: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._core = core
        self._groups = groups
        self._tags = groups.tags()
        self._store = GroupedStore(core, groups, core.block_tokens)
        self._wait = core.config.lookup_wait
        self._lookups = Lookups(self._store, clock, workers=LOOKUP_THREADS)
        self._yielded = 0.0
        self._loads = loads and groups.loadable
        self._saves = saves and groups.loadable
        self._clock = clock
        self._async = async_loads or groups.hybrid
        """A hybrid model's loads are async: vLLM can undo a failed one for every group
        (``failed_recving``), never a failed synchronous one (it stops)."""
        self._waiting_loads: dict[str, list[Transfer]] = {}
        """Async loads vLLM allocated blocks for, to send with the next step."""
        self._block = core.block_tokens
        self._requests: dict[str, _Request] = {}
        self._loaded: list[dict[str, Lease]] = [{} for _ in range(max(1, steps_in_flight))]
        """Pins of the loads sent in the last ``steps_in_flight`` steps, by request: a load
        has run once vLLM plans that many steps after it (one, or two with async
        scheduling), so its pin goes then, or at the request's end."""

    # -- admission ----------------------------------------------------------------------

    def matched(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: tokens beyond vLLM's own hit to load (never all
        of them: the last token is always computed), or ``None`` to be asked again."""
        state = self._state(request)
        if state is None or not self._loads:
            return 0, False
        cap = min(len(state.keys), (request.num_tokens - 1) // self._block)
        if state.asking is not None and not self._heard(state):
            return None, False  # asked on the connector's threads: answered on a later call
        stale = self._clock() - state.looked_at > _REPIN_S
        # vLLM's own hit (num_computed) may have moved while the lookup ran: an answer for
        # another one would load into the wrong blocks, so it is asked again.
        if state.hit is None or state.local != num_computed or stale or self._waiting(state, cap):
            self._look(state, cap, num_computed)
            if state.asking is not None:
                return None, False
        if self._waiting(state, cap):
            return None, False  # the prefill's blocks are on their way
        assert state.hit is not None
        extra = state.hit - num_computed // self._block
        state.offered = max(extra, 0) * self._block
        return (extra * self._block, self._async) if extra > 0 else (0, False)

    def may_load_async(self) -> bool:
        """Whether :meth:`matched` may answer an async load (vLLM 0.34 asks, cheaply)."""
        return self._loads and self._async

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """``update_state_after_alloc``: the load range, once vLLM gave it blocks (an async
        load goes out with the next step: the request is not scheduled until it ends)."""
        state = self._requests.get(request.request_id)
        if state is None:
            return
        if state.offered > num_external_tokens:  # a hit vLLM did not take
            self._core.stats.declined(state.offered - num_external_tokens)
        state.offered = 0
        if num_external_tokens > 0:
            first = state.local // self._block
            state.load = (first, first + num_external_tokens // self._block)
            if self._async:
                self._plan_async(request.request_id, state, blocks)
        else:
            self._lookups.unpin(state.hold)
            state.hold = None
        state.hit = None  # admitted: a later re-admission looks again

    # -- each step ------------------------------------------------------------------------

    def build(self, out: Any) -> StepMeta:
        """``build_connector_meta``: this step's loads and saves."""
        for hold in self._loaded.pop(0).values():
            self._lookups.unpin(hold)
        self._loaded.append({})
        meta = StepMeta(preempted=sorted(out.preempted_req_ids or ()))
        for req_id, loads in self._waiting_loads.items():
            meta.async_loads.extend(loads)
            state = self._requests.get(req_id)
            if state is not None and state.hold is not None:
                self._loaded[-1][req_id], state.hold = state.hold, None
        self._waiting_loads = {}
        for req_id in meta.preempted:
            state = self._requests.get(req_id)
            if state is not None:
                state.block_ids, state.load = [], None
        steps = out.num_scheduled_tokens
        for new in out.scheduled_new_reqs:
            end = new.num_computed_tokens + steps[new.req_id]
            self._step(meta, new.req_id, new.block_ids, replace=True, end=end)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            resumed = req_id in cached.resumed_req_ids
            end = cached.num_computed_tokens[i] + steps[req_id]
            self._step(meta, req_id, cached.new_block_ids[i], replace=resumed, end=end)
        return meta

    def report(self, report: WorkerReport | None) -> None:
        """``update_connector_output``: remember the keys whose load failed, and save again
        the blocks of requests whose saves were dropped (a failed load in their step)."""
        if report is None:
            return
        if report.failed:
            self._core.mark_failed(list(report.failed))
        for req_id in report.unsaved:
            state = self._requests.get(req_id)
            if state is not None:
                state.saved = 0

    def finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished``: keep the blocks while a save may read them; a prefill
        tells its decode how many blocks it saved."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        self._forget(state)
        self._waiting_loads.pop(request.request_id, None)
        for loaded in self._loaded:
            self._lookups.unpin(loaded.pop(request.request_id, None))
        params = {PD_PARAM: state.saved} if self._saves and state.saved else None
        return state.saves, params

    # -- internals ------------------------------------------------------------------------

    def _state(self, request: Any) -> _Request | None:
        state = self._requests.get(request.request_id)
        if state is None:
            tokens = request.prompt_token_ids
            if (
                tokens is None
                or request.mm_features
                or getattr(request, "prompt_embeds", None) is not None
            ):
                return None  # what the KV is does not follow from token ids alone
            extra = _extra(request)
            keys = GroupedKeys([self._core.keys(tokens, extra + tag) for tag in self._tags])
            state = self._requests[request.request_id] = _Request(keys, tokens)
            params = request.kv_transfer_params or {}
            expect = params.get(PD_PARAM)
            if isinstance(expect, int) and not isinstance(expect, bool) and expect > 0:
                state.expect = min(expect, len(keys))
                state.wait_until = self._clock() + self._core.config.pd_wait
        return state

    def _look(self, state: _Request, cap: int, num_computed: int) -> None:
        now = self._clock()
        if (
            state.hit is not None
            and state.local == num_computed
            and now - state.looked_at < _RELOOK_S
        ):
            return
        self._lookups.unpin(state.hold)
        state.hold, state.local, state.looked_at = None, num_computed, now
        first = num_computed // self._block
        keys = state.keys[:cap]
        seen = self._store.mirrored(keys) if cap > first else 0
        if seen is not None and seen <= first:
            state.hit = 0  # vLLM holds every block the store has (its mirror says)
        else:
            state.hit, state.asking = None, self._lookups.start(keys, first, seen)

    def _heard(self, state: _Request) -> bool:
        """Whether the lookup in flight settled: answered, or given up on once it took
        longer than ``lookup_wait`` (a miss; its late pin is released)."""
        asking = state.asking
        assert asking is not None
        answer = asking.answer()
        if answer is None:
            if self._clock() - asking.started < self._wait:
                self._yield()
                return False
            self._lookups.unpin(asking.drop())
            answer = (0, None)
            self._core.stats.lookup_late()
        state.asking = None
        state.hit, state.hold = answer
        return True

    def _yield(self) -> None:
        """Hand the GIL to the lookup threads, at most once a millisecond: an idle vLLM
        loop spins and would starve them (a lookup then took 50-60 ms, 3-10 ms with
        this); once per waiting request it would cost a step hundreds of hand-offs."""
        now = time.perf_counter()
        if now - self._yielded >= _YIELD_EVERY_S:
            self._yielded = now
            time.sleep(0)

    def _forget(self, state: _Request) -> None:
        """The request is done with its lookups: release what they pinned."""
        if state.asking is not None:
            self._lookups.unpin(state.asking.drop())
            state.asking = None
        self._lookups.unpin(state.hold)
        state.hold = None

    def close(self) -> None:
        """Stop the lookup thread (after the releases queued so far)."""
        self._lookups.close()

    def _plan_async(self, req_id: str, state: _Request, blocks: Any) -> None:
        """The blocks vLLM gave the loaded tokens, in every group (one group's: the whole
        list when it covers them, else the new, unhashed ones, which are exactly those)."""
        assert state.load is not None
        first, last = state.load
        state.load = None
        per_group = [list(ids) for ids in blocks.get_block_ids()]
        if not self._groups.hybrid and len(per_group[0]) < last:
            per_group = [[0] * first + list(blocks.get_unhashed_block_ids())]
        transfers = self._transfers(req_id, state, per_group, first, last)
        self._waiting_loads[req_id] = transfers

    def _waiting(self, state: _Request, cap: int) -> bool:
        wanted = min(state.expect, cap)
        return state.hit is not None and state.hit < wanted and self._clock() < state.wait_until

    def _step(
        self,
        meta: StepMeta,
        req_id: str,
        block_ids: tuple[list[int], ...] | None,
        *,
        replace: bool,
        end: int,
    ) -> None:
        """One scheduled request: its blocks (``replace`` for new and resumed ones), its
        load, and the prompt blocks full once it computed up to token ``end``."""
        state = self._requests.get(req_id)
        if state is None:
            return
        if replace or not state.block_ids:
            state.block_ids = [list(ids) for ids in block_ids] if block_ids else []
        elif block_ids:
            for held, ids in zip(state.block_ids, block_ids, strict=True):
                held.extend(ids)
        if state.load is not None:
            first, last = state.load
            state.load = None
            meta.loads.extend(self._transfers(req_id, state, state.block_ids, first, last))
            if state.hold is not None:
                self._loaded[-1][req_id] = state.hold
                state.hold = None
        if not self._saves:
            return
        full = min(end // self._block, len(state.keys))
        if full > state.saved:
            saves = self._transfers(req_id, state, state.block_ids, state.saved, full, save=True)
            meta.saves.extend(saves)
            state.saved, state.saves = full, True

    def _transfers(
        self,
        req_id: str,
        state: _Request,
        block_ids: list[list[int]],
        first: int,
        last: int,
        *,
        save: bool = False,
    ) -> list[Transfer]:
        """Blocks ``[first, last)`` of the prompt in each group that keeps them: a window
        group only its tail at ``last`` for a load (vLLM's null block elsewhere), and for
        a save whatever it still holds, saved before the next forward may reuse them."""
        moves = []
        # no block ids (a preempted request's, dropped) is no transfer
        groups = zip(self._groups.groups, state.keys.per_group, block_ids, strict=False)
        for group, keys, ids in groups:
            lo = first if save else max(first, group.first_kept(last, self._block))
            hi = min(last, len(ids), len(keys))
            while lo < hi and ids[lo] == NULL_BLOCK:  # a window's places before its tail
                lo += 1
            if NULL_BLOCK in ids[lo:hi]:  # never read or write the null block
                hi = ids.index(NULL_BLOCK, lo, hi)
            if lo < hi:
                parent: BlockKey | None = None
                tokens: tuple[int, ...] = ()
                if save:  # what the server's events tell KV-aware routers
                    parent = keys[lo - 1] if lo else None
                    tokens = tuple(state.tokens[lo * self._block : hi * self._block])
                moves.append(
                    _transfer(
                        req_id, keys[lo:hi], ids[lo:hi], lo, group, parent=parent, token_ids=tokens
                    )
                )
        return moves


def _transfer(
    request: str,
    keys: Iterable[BlockKey],
    block_ids: Iterable[int],
    start: int,
    group: Group,
    *,
    parent: BlockKey | None = None,
    token_ids: tuple[int, ...] = (),
) -> Transfer:
    """A transfer of one group's blocks; a window group's save runs before the step ends
    (vLLM frees its blocks once they leave the window, and may hand them out at once).
    A save's ``parent`` and ``token_ids``: its lineage (``Transfer``)."""
    now = group.kind == "window"
    return Transfer(
        request, tuple(keys), tuple(block_ids), start, now, parent=parent, token_ids=token_ids
    )


def _extra(request: Any) -> bytes:
    """What besides the token ids decides a request's KV: its LoRA adapter (by its files,
    :func:`_adapter`), its salt."""
    parts = []
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        parts.append(f"lora={_adapter(str(lora.lora_path))}")
    salt = getattr(request, "cache_salt", None)
    if salt:
        parts.append(f"salt={salt}")
    return "\n".join(parts).encode()


@functools.lru_cache(maxsize=256)
def _adapter(path: str) -> str:
    """A LoRA adapter named by its files, as the model's weights are (``weights``), never
    by the name it was loaded under: two adapters loaded as ``chat`` on one base model
    would otherwise load each other's KV. An adapter whose files cannot be named (a hub
    branch with no commit in the local cache) gets this process's salt: it shares nothing
    with another engine. Cached per path (a digest reads up to 1 MiB of each file)."""
    named = weights(path)
    return f"{named.name}#{PROCESS_SALT}" if named.doubt else named.name
