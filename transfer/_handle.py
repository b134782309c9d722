"""TransferHandle: completion of one batch, for threads and for asyncio."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Generator
from typing import Any

from ._errors import TransferError

_DRIVE_S = 0.002
"""How long ``wait()`` drives a one-sided batch itself before it sleeps on the latch."""


class TransferHandle:
    """The completion of one batch of reads or writes.

    ``done`` is true once every byte has landed (for a write: acknowledged by the remote
    side; for a read: in local memory) or the batch has failed. Until then the caller must
    not reuse or free the source or destination memory. ``wait()`` raises the batch's
    :class:`TransferError`; ``await handle`` works from asyncio.
    """

    def __init__(
        self,
        nbytes: int,
        parts: int,
        on_settle: Callable[[TransferHandle], None] | None = None,
        progress: Callable[[], object] | None = None,
    ) -> None:
        self.bytes = nbytes
        self._progress = progress
        """Drives the batch on (a one-sided transport's poll): ``wait()`` calls it itself
        rather than wait for the transport's thread to hand the completion over."""
        self._parts = parts
        self._error: TransferError | None = None
        # A latch: held until the batch is done. A waiter acquires it and lets it go at
        # once (so every waiter passes); a lock is a C-level wait and wake, where an Event
        # is a Condition in Python with a fresh lock per wait (~20% of a small op's time).
        self._latch = threading.Lock()
        self._latch.acquire()
        self._done = False
        self._settling = False
        self._lock = threading.Lock()
        self._on_settle = on_settle
        self._callbacks: list[Callable[[TransferHandle], None]] = []
        if parts == 0:
            self._settle()

    @property
    def done(self) -> bool:
        return self._done

    @property
    def error(self) -> TransferError | None:
        return self._error

    def wait(self, timeout: float | None = None) -> None:
        """Block until done; raise ``TimeoutError`` after ``timeout`` s, or the batch error."""
        if not self._done:
            if self._progress is not None:
                self._drive(self._progress)
            if not self._latch.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
                raise TimeoutError(f"transfer of {self.bytes} bytes not done after {timeout} s")
            self._latch.release()
        if self._error is not None:
            raise self._error

    def _drive(self, progress: Callable[[], object]) -> None:
        """Poll for up to ``_DRIVE_S``: a small op is done within it, without a hand-over
        from another thread; a longer one is left to the transport's thread."""
        end = time.monotonic() + _DRIVE_S
        while not self._done and time.monotonic() < end:
            progress()

    def add_done_callback(self, callback: Callable[[TransferHandle], None]) -> None:
        """Call ``callback(handle)`` once done (at once if already done), on some thread."""
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback(self)

    def __await__(self) -> Generator[Any, None, None]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()

        def settle(_: TransferHandle) -> None:
            loop.call_soon_threadsafe(_resolve, future, self._error)

        self.add_done_callback(settle)
        return future.__await__()

    # -- for the engine (its batches complete handles through these; callers do not) --

    def part_done(self) -> None:
        """One part (a frame, or the notification) is done."""
        with self._lock:
            if self._settling:
                return
            self._parts -= 1
            last = self._parts == 0
        if last:
            self._settle()

    def fail(self, error: TransferError) -> None:
        with self._lock:
            if self._settling:
                return
            self._error = error
        self._settle()

    def _settle(self) -> None:
        """Release what the batch held (``on_settle``), then report done: a caller that
        returns from ``wait()`` may unregister the batch's regions at once."""
        with self._lock:
            if self._settling:
                return
            self._settling = True
        if self._on_settle is not None:
            self._on_settle(self)
        with self._lock:
            self._done = True
            self._latch.release()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)


def _resolve(future: asyncio.Future[None], error: TransferError | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
