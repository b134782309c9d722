"""``kvbridge proxy``'s log: bounded in rate, and never a wait for whoever serves.

Two things a stranger could do to the proxy through its log, and what stops each:

- make it write a line (a traceback, even) per connection, as fast as they can connect:
  every warning and error is logged at a bounded rate (``_Repeats``, which hands them to
  ``kvbridge._bounded_log.BoundedLog``): one line per kind every 10 s, the next one saying
  how many more there were. A kind is the logger and the message's template (its first
  line, with numbers, addresses and quoted parts left out), so "socket.accept() out of
  system resource" from asyncio is one kind however many sockets fail; each line is one
  line (an exception is named, its traceback left out). Access lines (info) are not
  bounded: there is one per answered request.
- stall it when nobody reads its stderr (a pipe read slowly, or not at all): no thread
  that serves ever writes. A record goes into a bounded queue (``LOG_QUEUE_RECORDS``)
  without waiting, or is dropped and counted when the queue is full; the first record that
  fits after drops is preceded by a line saying how many were dropped. One thread, owned
  by ``ProxyLog`` (``close`` stops and joins it), takes the records out and writes them to
  the descriptor, waiting for it to take bytes (``select``) rather than blocking in
  ``write(2)``, so that it hears ``close``: once closing, what the descriptor does not take
  within ``STOP_GRACE_S`` is dropped, and the proxy exits even with its stderr stuck.

Python's warnings go the same way (``logging.captureWarnings``).
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import queue
import re
import select
import threading
import time

from kvbridge._bounded_log import BoundedLog

from ._fail import one_line

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

LOG_QUEUE_RECORDS = 4096
"""Records waiting for the writer at most: a few seconds of access lines at a thousand
requests a second, while stderr is slow. A waiting record (formatted, with its message) is
well under 2 KiB, so the queue holds under 8 MiB."""

STOP_GRACE_S = 1.0
"""On close, the writer waits this long in all for stderr to take what is left, then drops
the rest: an exit is not held up by a reader that went away."""

WAIT_ROUND_S = 0.5
"""The writer's longest wait for stderr before it looks whether it is closing."""

KIND_CHARS = 120
"""A kind is the first this many characters of a message's template."""

MAX_KINDS = 256
"""Kinds told apart at most; past them a logger's further kinds are one (a message that
names what varies, instead of passing it as an argument, cannot grow the table)."""

LINE_CHARS = 2000
"""A bounded line is cut to this length."""

PIPE_BUF = getattr(select, "PIPE_BUF", 512)
"""A write this long to a pipe that ``select`` says is writable never blocks."""

_VARYING = re.compile(r"0x[0-9a-fA-F]+|\d+|<[^<>]*>|'[^']*'|\"[^\"]*\"")

_log = logging.getLogger("kvbridge.proxy")


class ProxyLog:
    """The proxy process's logging, in place of the root logger's handlers from ``start``
    to ``close`` (a context manager too). ``dropped``: records the queue had no room for."""

    def __init__(self, level: int, fd: int = 2) -> None:
        self._level = level
        self._records: queue.Queue[logging.LogRecord | None] = queue.Queue(LOG_QUEUE_RECORDS)
        self._handler = _DroppingQueueHandler(self._records)
        self._handler.addFilter(_Repeats())
        self._writer = _FdWriter(fd)
        self._writer.setFormatter(logging.Formatter(LOG_FORMAT))
        self._listener = _Listener(self._records, self._writer)
        self._saved: tuple[list[logging.Handler], int] | None = None

    @property
    def dropped(self) -> int:
        return self._handler.dropped

    def start(self) -> None:
        root = logging.getLogger()
        self._saved = (root.handlers[:], root.level)
        for handler in self._saved[0]:
            root.removeHandler(handler)
        self._listener.start()
        root.addHandler(self._handler)
        root.setLevel(self._level)
        logging.captureWarnings(True)

    def close(self) -> None:
        """Stop taking records, write what stderr takes within ``STOP_GRACE_S``, join the
        writer's thread."""
        if self._saved is None:
            return
        logging.captureWarnings(False)
        root = logging.getLogger()
        root.removeHandler(self._handler)
        handlers, level = self._saved
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        self._saved = None
        self._writer.stop_soon()
        self._listener.stop()

    def __enter__(self) -> ProxyLog:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _DroppingQueueHandler(logging.handlers.QueueHandler):
    """Hands each record to the bounded queue without waiting: when it is full the record is
    dropped and counted, and the next one that fits comes after a line saying how many."""

    def __init__(self, records: queue.Queue[logging.LogRecord | None]) -> None:
        super().__init__(records)
        self.dropped = 0
        self._told = 0

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            if self.dropped > self._told:
                self.queue.put_nowait(self._notice(self.dropped - self._told))
                self._told = self.dropped
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802  (logging's name)
        """A record that would not format is dropped too (``Handler.handleError`` would
        write its traceback to stderr from the thread that logged)."""
        self.dropped += 1

    def _notice(self, count: int) -> logging.LogRecord:
        record = _log.makeRecord(
            _log.name,
            logging.WARNING,
            __file__,
            0,
            "%d log lines dropped: stderr did not take them fast enough",
            (count,),
            None,
        )
        prepared: logging.LogRecord = self.prepare(record)
        return prepared


class _Repeats(logging.Filter):
    """Lets each kind of warning or error through ``BoundedLog`` (one line per kind per
    interval, with a count): the filter drops the record, and the bounded line, logged
    again by the same logger, passes."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._bounded: dict[str, BoundedLog] = {}
        self._kinds: set[str] = set()
        self._passing = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or getattr(self._passing, "on", False):
            return True
        kind, bounded = self._kind(record)
        self._passing.on = True
        try:
            bounded.refused(kind, record.levelno, "%s", _one_line(record))
        finally:
            self._passing.on = False
        return False

    def _kind(self, record: logging.LogRecord) -> tuple[str, BoundedLog]:
        template = str(record.msg).split("\n", 1)[0]
        kind = f"{record.levelno} {_VARYING.sub('_', template)[:KIND_CHARS]}"
        if record.exc_info and record.exc_info[0] is not None:
            kind += f" {record.exc_info[0].__name__}"
        with self._lock:
            if kind not in self._kinds and len(self._kinds) >= MAX_KINDS:
                kind = f"{record.levelno} (another)"
            self._kinds.add(kind)
            bounded = self._bounded.get(record.name)
            if bounded is None:
                bounded = self._bounded[record.name] = BoundedLog(logging.getLogger(record.name))
        return kind, bounded


def _one_line(record: logging.LogRecord) -> str:
    """The record's message as one line: its first line, and the exception it carries."""
    try:
        text = record.getMessage()
    except (TypeError, ValueError):
        text = str(record.msg)
    text = text.split("\n", 1)[0]
    if record.exc_info and record.exc_info[1] is not None:
        exc = record.exc_info[1]
        text += f" ({type(exc).__name__}: {exc})"
    return one_line(text)[:LINE_CHARS]


class _FdWriter(logging.Handler):
    """Writes each record as a line to a descriptor from the listener's thread, waiting
    for the descriptor to take bytes (``select``) rather than blocking in ``write(2)``:
    pieces of at most ``PIPE_BUF`` bytes, each once the descriptor is writable. After
    ``stop_soon`` it waits ``STOP_GRACE_S`` in all, then drops what is left; a write that
    fails (the reader went away) drops the record."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd
        self._stop_by: float | None = None

    def stop_soon(self) -> None:
        self._stop_by = time.monotonic() + STOP_GRACE_S

    def emit(self, record: logging.LogRecord) -> None:
        view = memoryview((self.format(record) + "\n").encode("utf-8", "replace"))
        while view and self._writable():
            try:
                view = view[os.write(self._fd, view[:PIPE_BUF]) :]
            except OSError:
                return

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802  (logging's name)
        """A record that would not format is dropped (there is nowhere to say so)."""

    def _writable(self) -> bool:
        while True:
            stop_by = self._stop_by
            wait = WAIT_ROUND_S if stop_by is None else stop_by - time.monotonic()
            try:
                _, ready, _ = select.select([], [self._fd], [], max(0.0, min(wait, WAIT_ROUND_S)))
            except (OSError, ValueError):
                return False
            if ready:
                return True
            if stop_by is not None and time.monotonic() >= stop_by:
                return False


class _Listener(logging.handlers.QueueListener):
    """The writer's thread. Its stop waits for room for the sentinel (the writer, closing,
    drains the queue within ``STOP_GRACE_S`` per record at most), where the base class
    would fail on a full queue."""

    def __init__(
        self, records: queue.Queue[logging.LogRecord | None], writer: logging.Handler
    ) -> None:
        super().__init__(records, writer)
        self._records = records

    def enqueue_sentinel(self) -> None:
        self._records.put(None)  # QueueListener's sentinel
