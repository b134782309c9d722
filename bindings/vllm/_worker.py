"""The worker side of the vLLM connector: the KV cache as pages, loads before the forward,
saves handed to the saver thread after it, and the reports vLLM polls each step.

Source blocks of a save stay valid until it ran: while the request runs, vLLM does not
rewrite a full block; at its end ``request_finished`` kept them until this side reports
the request in ``finished_sending``; on preemption ``preempted`` waits for the request's
saves before vLLM's forward may reuse its blocks.
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
        self, core: ConnectorCore, steps_in_flight: int = 1, *, loader: bool = False
    ) -> None:
        """``steps_in_flight``: how many steps vLLM plans before it learns how the
        earlier ones ended (``max_concurrent_batches``: 2 with async scheduling);
        ``loader``: run async loads on a thread of this side's (joined by ``close``)."""
        self._core = core
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
        """``register_kv_caches``: every layer's cache, as uint8 pages (no copy). A layer
        the connector cannot move (on another kind of device, or whose blocks are not whole
        runs of bytes) is a :class:`ConfigError` naming it."""
        page_bytes = self._core.identity.block_bytes // max(1, len(kv_caches))
        pages = tuple(
            page
            for name, tensor in kv_caches.items()
            for page in tensor_pages(name, tensor, page_bytes)
        )
        first = next(iter(kv_caches.values()))
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
        if meta is None:
            return
        if meta.async_loads:
            assert self._loader is not None, "async loads need the loader (async_load)"
            self._loading.update(load.request for load in meta.async_loads)
            self._loader.submit(
                SaveJob(t.request, t.keys, t.block_ids, t.start) for t in meta.async_loads
            )
        if not meta.loads:
            return
        for load in meta.loads:
            if not self._core.load(load.keys, load.block_ids, load.start):
                self._invalid.update(load.block_ids)
                self._report.failed.update(load.keys)
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
        self._core.save_later(
            [SaveJob(s.request, s.keys, s.block_ids, s.start) for s in meta.saves]
        )

    def finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``get_finished``: ended requests whose saves all ran (sending done), and
        requests whose async load ended, well or not (receiving done; a failed one's
        blocks go to ``load_errors`` in this same step)."""
        self._ended.update(finished_req_ids & self._saving)
        done = {req for req in self._ended if not self._core.saving(req)}
        self._ended -= done
        self._saving -= done
        received = {req for req in self._loading if self._loader and not self._loader.busy(req)}
        self._loading -= received
        with self._lock:
            failed, self._failed_loads = self._failed_loads, []
        for job in failed:
            self._invalid.update(job.block_ids)
            self._report.failed.update(job.keys)
        return done or None, received or None

    def close(self) -> None:
        if self._loader is not None:
            self._loader.close()

    def _run_load(self, job: SaveJob) -> None:
        if not self._core.load(job.keys, job.block_ids, job.start):
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
