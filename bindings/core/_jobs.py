"""Saves that run off the engine's step: a thread that owns the queue, and per request
the count of jobs still to run, so that the engine learns when a request's source blocks
may be reused (``done``) and can wait for them before it overwrites them (``flush``)."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ..._closing import Closing
from ...store import BlockKey

_log = logging.getLogger("kvbridge.bindings")


@dataclass(frozen=True)
class SaveJob:
    """Blocks of one request: ``keys[i]`` is engine block ``block_ids[i]`` and the
    request's block ``start + i``."""

    request: str
    keys: tuple[BlockKey, ...]
    block_ids: tuple[int, ...]
    start: int = 0
    mark: object | None = field(default=None, compare=False)
    """Where the engine's device work was when the job was made (``ConnectorCore.mark``):
    the job moves no byte before that work ran."""
    parent: BlockKey | None = None
    """The key before ``keys[0]`` in its chain (``None`` at the prompt's start)."""
    token_ids: Sequence[int] = field(default=(), compare=False)
    """The blocks' token ids, for their lineage (``ConnectorCore.lineage``); none: none
    sent."""


SaveFn = Callable[[SaveJob], None]


class Saver(Closing):
    """Runs :class:`SaveJob` s in order on one thread (started here, joined by ``close``).

    ``save`` must not raise for a store fault: it logs and counts it; a job that raises
    anyway is logged and counted done (its blocks are then simply not cached).
    """

    def __init__(self, save: SaveFn, name: str = "kvbridge-saver") -> None:
        self._save = save
        self._queue: collections.deque[SaveJob] = collections.deque()
        self._pending: collections.Counter[str] = collections.Counter()
        self._changed = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, jobs: Iterable[SaveJob]) -> None:
        with self._changed:
            for job in jobs:
                self._queue.append(job)
                self._pending[job.request] += 1
            self._changed.notify_all()

    def busy(self, request: str) -> bool:
        with self._changed:
            return self._pending[request] > 0

    def idle(self) -> bool:
        with self._changed:
            return not self._pending

    def flush(self, requests: Sequence[str], timeout: float | None = None) -> bool:
        """Wait until no job of ``requests`` is queued or running; False on timeout (with
        ``None``, wait for as long as they run: a job must never read blocks the engine
        has given to another request)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while any(self._pending[r] for r in requests):
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or not self._thread.is_alive():
                    return False
                self._changed.wait(left)
            return True

    def close(self) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._queue and not self._closing:
                    self._changed.wait()
                if not self._queue:
                    return  # closing, and everything queued ran
                job = self._queue[0]
            try:
                self._save(job)
            except Exception:
                _log.exception("a save of %d block(s) failed", len(job.keys))
            with self._changed:
                self._queue.popleft()
                self._pending[job.request] -= 1
                if not self._pending[job.request]:
                    del self._pending[job.request]
                self._changed.notify_all()
