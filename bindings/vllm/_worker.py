"""The worker side of the vLLM connector: the KV cache as pages, loads before the forward,
saves handed to the saver thread after it, and the reports vLLM polls each step.

Source blocks of a save stay valid until it ran: while the request runs, vLLM does not
rewrite a full block of a full-attention group; at its end ``request_finished`` kept them
until this side reports the request in ``finished_sending``; on preemption ``preempted``
waits for the request's saves before vLLM's forward may reuse its blocks. A sliding
window's blocks are freed once they leave the window, and may be handed to another
request in the next step: those saves run before this step ends (``Transfer.now``).

A hybrid model's KV cache groups alias one another's memory (engine block ``b`` is the
same bytes in every group), so the cache is registered once per distinct tensor.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ..core._core import ConnectorCore
from ..core._jobs import SaveJob, Saver
from ..core._pages import PagedKV
from ..core._tensors import tensor_pages
from ._meta import KVBridgeStats, StepMeta, WorkerReport

_log = logging.getLogger("kvbridge.bindings")


class WorkerSide:
    def __init__(
        self,
        core: ConnectorCore,
        steps_in_flight: int = 1,
        *,
        loader: bool = False,
        by_request: bool = False,
        moves: bool = True,
        layout: str = "",
    ) -> None:
        """``steps_in_flight``: how many steps vLLM plans before it learns how the
        earlier ones ended (``max_concurrent_batches``: 2 with async scheduling);
        ``loader``: run async loads on a thread of this side's (joined by ``close``);
        ``by_request``: report a failed async load by request, not by block (a model of
        several KV cache groups: vLLM stops at block-level failures there); ``moves``:
        whether this model's blocks are loaded and saved at all (the cache is not even
        registered otherwise); ``layout``: vLLM's name of the KV cache layout (for
        messages)."""
        self._core = core
        self._by_request = by_request
        self._moves = moves
        self._layout = layout
        self._loader = Saver(self._run_load, name="kvbridge-loader") if loader else None
        self._loading: set[str] = set()
        self._lock = threading.Lock()
        self._failed_loads: list[SaveJob] = []
        """Async loads that failed, for the engine thread to report (loader thread writes)."""
        self._window = max(1, steps_in_flight)
        self._poisoned = 0
        """Steps whose saves are still dropped after a failed load."""
        self._saving: set[str] = set()
        """Requests any save was sent for: vLLM waits for them after they end."""
        self._ended: set[str] = set()
        self._invalid: set[int] = set()
        self._report = WorkerReport()

    def register(self, kv_caches: dict[str, Any]) -> None:
        """``register_kv_caches``: every distinct layer cache (KV cache groups and layers
        that share a cache share a tensor), as uint8 pages (no copy). A layer the connector
        cannot move (on another kind of device, or whose blocks are not whole runs of
        bytes) is a :class:`ConfigError` naming it and the layout."""
        if not self._moves:
            return
        distinct = _distinct(kv_caches)
        page_bytes = self._core.identity.block_bytes // max(1, len(distinct))
        pages = tuple(
            page
            for name, tensor in distinct.items()
            for page in tensor_pages(name, tensor, page_bytes, self._layout)
        )
        first = next(iter(distinct.values()))
        expected = self._core.identity.dtype
        if str(first.dtype) != expected:
            raise ValueError(f"kvbridge: the KV cache is {first.dtype}, the config said {expected}")
        descriptor = f"{first.dtype}/{tuple(first.shape[1:])}/{first.device.type}"
        self._core.attach(PagedKV(pages, descriptor))

    def preempted(self, meta: StepMeta | None) -> None:
        """``handle_preemptions``: before this step's forward may overwrite the blocks of
        preempted requests, their saves must have run (each ends within the store's
        timeouts, and a store that failed a moment ago is not asked: this wait is bounded)."""
        if meta is not None and meta.preempted:
            self._core.flush(meta.preempted)

    def load(self, meta: StepMeta | None) -> None:
        """``start_load_kv``: fill this step's loaded blocks before the forward; hand async
        loads to the loader thread."""
        if meta is None or not (meta.loads or meta.async_loads):
            return
        mark = self._core.mark()  # vLLM's work on the blocks so far (zeroing new ones)
        if meta.async_loads:
            assert self._loader is not None, "async loads need the loader (async_load)"
            self._loading.update(load.request for load in meta.async_loads)
            self._loader.submit(
                SaveJob(t.request, t.keys, t.block_ids, t.start, mark) for t in meta.async_loads
            )
        for load in meta.loads:
            # The blocks before a bad one (one gone, one that failed its checksum) are
            # whole: vLLM recomputes from the first invalid block on.
            loaded = self._core.load_leading(
                load.keys, load.block_ids, load.start, partial=False, after=mark
            )
            if loaded < len(load.keys):
                self._invalid.update(load.block_ids[loaded:])
                self._report.failed.update(load.keys[loaded:])
                self._poisoned = self._window

    def save(self, meta: StepMeta | None) -> None:
        """``wait_for_save``: queue the blocks that became full in this step. If a load
        failed in this step or in one vLLM planned before learning of it, the step's
        forward may have read wrong KV (any request may share the failed blocks through
        vLLM's prefix cache): nothing of it is saved, and its requests save again later."""
        poisoned, self._poisoned = self._poisoned > 0, max(0, self._poisoned - 1)
        if meta is None or not meta.saves:
            return
        self._saving.update(save.request for save in meta.saves)
        if poisoned:
            self._report.unsaved.update(save.request for save in meta.saves)
            return
        mark = self._core.mark()  # the forward that wrote the blocks
        later = []
        for s in meta.saves:
            job = SaveJob(s.request, s.keys, s.block_ids, s.start, mark, s.parent, s.token_ids)
            if s.now:
                self._core.run_save(job)
            else:
                later.append(job)
        self._core.save_later(later)

    def finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None, set[str]]:
        """``get_transfer_results``: ended requests whose saves all ran (sending done),
        requests whose async load ended, well or not (receiving done), and those whose
        async load failed: by request (``failed_recving``: vLLM recomputes the whole hit,
        in every group) where ``by_request``, else by block (``load_errors``, this step)."""
        self._ended.update(finished_req_ids & self._saving)
        done = {req for req in self._ended if not self._core.saving(req)}
        self._ended -= done
        self._saving -= done
        received = {req for req in self._loading if self._loader and not self._loader.busy(req)}
        self._loading -= received
        with self._lock:
            failed, self._failed_loads = self._failed_loads, []
        failed_requests = set()
        for job in failed:
            self._report.failed.update(job.keys)
            if self._by_request:
                failed_requests.add(job.request)
            else:
                self._invalid.update(job.block_ids)
        return done or None, received or None, failed_requests

    def close(self) -> None:
        if self._loader is not None:
            self._loader.close()

    def _run_load(self, job: SaveJob) -> None:
        """An async load, on the loader thread: one that did not fill its blocks (failed,
        or raised: a bad block id) is reported failed, never received."""
        try:
            loaded = self._core.load(job.keys, job.block_ids, job.start, after=job.mark)
        except Exception:
            _log.exception("kvbridge: an async load of %d block(s) failed", len(job.keys))
            loaded = False
        if not loaded:
            with self._lock:
                self._failed_loads.append(job)

    def load_errors(self) -> set[int]:
        invalid, self._invalid = self._invalid, set()
        return invalid

    def report(self) -> WorkerReport | None:
        report, self._report = self._report, WorkerReport()
        return report if report.failed or report.unsaved else None

    def stats(self) -> KVBridgeStats | None:
        data = self._core.stats.take()
        return KVBridgeStats(data=data) if any(data.values()) else None


def _distinct(kv_caches: dict[str, Any]) -> dict[str, Any]:
    """Each layer cache once: layers that share memory (of different KV cache groups, a
    hybrid model's; or sharing one layer's KV, vLLM's ``kv_sharing_target_layer_name``)
    are one tensor, named by the first layer seen."""
    seen: dict[tuple[int, int], str] = {}
    for name, tensor in kv_caches.items():
        seen.setdefault((int(tensor.data_ptr()), int(tensor.nbytes)), name)
    return {name: kv_caches[name] for name in seen.values()}
