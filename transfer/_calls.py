"""The threads that answer ``call`` requests, so that one slow call never holds up another
session's.

The control thread reads, checks and orders requests; each verified ``call`` becomes a job
queued under its session. A session's jobs run one at a time, in the order they came (a
client's cast and its next call keep their order); different sessions' jobs run on
different threads at once. A finished job's answer goes back to the control thread (only it
may use the ROUTER socket) through an inproc socket it polls.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from ._errors import RemoteProtocolError

_log = logging.getLogger("kvbridge.transfer")

CALL_THREADS = 4
"""Calls answered at once. A call waiting on a disk or a lock holds one thread; four let
the other sessions' calls through while up to three wait."""
MAX_QUEUED_CALLS = 64
"""Calls of one session waiting for their turn; past this a call is refused (a client has
one call in flight, plus casts, so only a flood reaches it)."""

Job = Callable[[], list[bytes]]
"""Runs one call; returns the ROUTER frames of its answer."""


class CallsFull(RemoteProtocolError):
    """A session has :data:`MAX_QUEUED_CALLS` calls waiting already."""


class CallPool:
    """``CALL_THREADS`` threads answering queued calls, each session's in order."""

    def __init__(self, context: zmq.Context[Any], answers: str) -> None:
        self._context = context
        self._answers = answers  # the inproc endpoint the control thread reads answers on
        self._lock = threading.Lock()
        self._waiting: dict[bytes, deque[Job]] = {}  # sessions with a job queued or running
        self._ready: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._run, name=f"kvbridge-call-{i}", daemon=True)
            for i in range(CALL_THREADS)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, session: bytes, job: Job) -> None:
        """Queue ``job`` behind ``session``'s earlier calls (:class:`CallsFull` past the cap)."""
        with self._lock:
            jobs = self._waiting.get(session)
            if jobs is None:
                self._waiting[session] = deque([job])
                self._ready.put(session)
            elif len(jobs) > MAX_QUEUED_CALLS:
                raise CallsFull(f"more than {MAX_QUEUED_CALLS} calls of this session queued")
            else:
                jobs.append(job)

    def busy(self, session: bytes) -> bool:
        """Whether ``session`` has a call queued or running here."""
        with self._lock:
            return session in self._waiting

    def queued(self) -> int:
        """Calls queued or running, every session's."""
        with self._lock:
            return sum(len(jobs) for jobs in self._waiting.values())

    def close(self) -> None:
        """Stop the threads after the jobs they are running; join them. Jobs still queued
        are dropped (the control socket closes next: their clients see no answer)."""
        for _ in self._threads:
            self._ready.put(None)
        for thread in self._threads:
            thread.join()

    def _run(self) -> None:
        out = self._context.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 1000)
        out.connect(self._answers)
        try:
            while (session := self._ready.get()) is not None:
                self._serve(session, out)
        finally:
            out.close()

    def _serve(self, session: bytes, out: zmq.Socket[Any]) -> None:
        with self._lock:
            job = self._waiting[session][0]
        try:
            out.send_multipart(job())
        except Exception:  # a job answers every error itself: this is a bug, keep serving
            _log.exception("control: a call's answer was lost")
        with self._lock:
            jobs = self._waiting[session]
            jobs.popleft()
            if jobs:
                self._ready.put(session)  # its next call, behind other sessions' turns
            else:
                del self._waiting[session]
