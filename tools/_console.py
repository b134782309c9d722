"""The demo's progress bar."""

from __future__ import annotations

import sys


class Progress:
    """A progress bar on stderr (a line per tenth when stderr is not a terminal)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.tty = sys.stderr.isatty()

    def update(self, done: int) -> None:
        width = 30
        filled = width * done // self.total
        bar = "#" * filled + "-" * (width - filled)
        end = "" if self.tty else "\n"
        if self.tty or done == self.total or done % max(1, self.total // 10) == 0:
            print(f"\r[{bar}] {done}/{self.total} requests", end=end, file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.tty:
            print(file=sys.stderr)
