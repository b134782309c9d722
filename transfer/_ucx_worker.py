"""The UCX worker of a transport: a UCX context and worker, and the one thread that makes
every call on them (ucxx objects are not thread-safe). Stream threads hand it closures and
wait on futures; it drives the worker in blocking mode (``arm`` then ``poll`` on its event
fd: no busy loop). A future settles only once UCX says each of its requests is finished
or cancelled: whoever waits on one knows that UCX no longer touches its buffers after.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import select
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

UCX_DEFAULTS = {
    "TLS": "^cma",
    "TCP_RX_SEG_SIZE": "512K",
    "TCP_TX_SEG_SIZE": "512K",
    "MM_ERROR_HANDLING": "y",
}
"""UCX settings applied unless the user set ``UCX_<name>`` (see ``_ucx``'s docstring)."""

_CLOSE_PROGRESS_ROUNDS = 100


class Worker:
    """A UCX context and worker, and the one thread that makes every call on them."""

    def __init__(self) -> None:
        import ucxx._lib.libucxx as ucx  # noqa: PLC0415 - optional dependency
        from ucxx._lib.arr import Array  # noqa: PLC0415

        self.ucx: Any = ucx
        self.Array: Any = Array
        self._gpu = _current_gpu()  # UCX finds CUDA memory when a context exists first
        config = {k: v for k, v in UCX_DEFAULTS.items() if f"UCX_{k}" not in os.environ}
        self._context = ucx.UCXContext(
            config_dict=config, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP)
        )
        self.worker = ucx.UCXWorker(self._context)
        self.worker.init_blocking_progress_mode()
        self.address: bytes = self.worker.address.tobytes()
        self._commands: deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = deque()
        self._pending: list[tuple[list[Any], concurrent.futures.Future[Any], Any]] = []
        self._lock = threading.Lock()
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # a full pipe already means "wake up"
        self._thread = threading.Thread(target=self._run, name="kvbridge-ucx", daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn`` on the worker thread. It returns ``(requests, result)``; the future
        gets ``result`` once every request completed, or the first request's error."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:  # the wake pipe is closed under this lock too
            if self._stopping:
                future.set_exception(EOFError("the UCX transport is closed"))
                return future
            self._commands.append((fn, future))
            self._wake()
        return future

    def run(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the worker thread and return once it ran: at once when called
        there, not at all once the worker is closed (nothing runs or progresses then)."""
        if threading.current_thread() is self._thread:
            fn()
            return

        def step() -> Any:
            fn()
            return [], None

        with contextlib.suppress(EOFError):
            self.call(step).result()

    def posted(self) -> int:
        """Operations posted and not yet finished or cancelled (for tests and stats)."""
        return sum(not future.done() for _, future, _ in list(self._pending))

    def close(self) -> None:
        """Run what is queued (endpoint closes), stop the thread, then free UCX objects in
        order: endpoints first (their owners dropped them), the worker, the context."""
        with self._lock:
            self._stopping = True
            self._wake()
        self._thread.join()
        with self._lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
        self.worker = None
        self._context = None

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        if self._gpu is not None:
            self._gpu.use()  # device memory is posted and progressed from this thread
        poller = select.poll()
        poller.register(self.worker.epoll_file_descriptor, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        try:
            while True:
                self.worker.progress()
                with self._lock:
                    commands, self._commands = self._commands, deque()
                    stopping = self._stopping
                for fn, future in commands:
                    self._start(fn, future)
                if stopping:
                    for _ in range(_CLOSE_PROGRESS_ROUNDS):  # let endpoint closes go out
                        self.worker.progress()
                    return
                self._finish_completed()
                if commands or not self.worker.arm():
                    continue  # more to do before sleeping
                poller.poll()
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
        finally:
            self._fail_all(EOFError("the UCX transport is closed"))
            with contextlib.suppress(Exception):
                self.worker.cancel_inflight_requests()

    def _start(self, fn: Callable[[], Any], future: concurrent.futures.Future[Any]) -> None:
        try:
            requests, result = fn()
        except Exception as exc:
            settle(future, exc=exc)
            return
        self._pending.append((list(requests), future, result))

    def _finish_completed(self) -> None:
        still = []
        for requests, future, result in self._pending:
            if future.done():  # cancelled by a closing pipe
                continue
            if all(r.completed for r in requests):
                try:
                    for r in requests:
                        r.check_error()
                except Exception as exc:
                    settle(future, exc=exc)
                else:
                    settle(future, result=result() if callable(result) else result)
            else:
                still.append((requests, future, result))
        self._pending = still

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            commands, self._commands = self._commands, deque()
        for _, future in commands:
            settle(future, exc=exc)
        for _, future, _ in self._pending:
            settle(future, exc=exc)
        self._pending = []


def _current_gpu() -> Any:
    """The current cupy device, its CUDA context made, or ``None`` without cupy or GPU."""
    try:
        import cupy  # noqa: PLC0415 - optional dependency

        device = cupy.cuda.Device()
        cupy.cuda.runtime.free(0)  # makes the primary context
    except Exception:  # no cupy, no driver, or no GPU
        return None
    return device


def settle(
    future: concurrent.futures.Future[Any], *, result: Any = None, exc: BaseException | None = None
) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if exc is None:
            future.set_result(result)
        else:
            future.set_exception(exc)
