"""One-line command-line errors: every failure the ``kvbridge`` command reports is one line
on stderr and a non-zero exit status, never a traceback."""

from __future__ import annotations

import sys


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) made one space."""
    return " ".join(text.split())


def fail(prefix: str, error: BaseException | str, status: int = 2) -> int:
    """Print ``prefix: error`` as one line on stderr; return ``status`` (the exit code)."""
    print(one_line(f"{prefix}: {error}"), file=sys.stderr, flush=True)
    return status


def unexpected(error: BaseException) -> int:
    """The last resort of ``main``: ``kvbridge: error: <kind>: <message>``, exit 1."""
    return fail("kvbridge: error", f"{type(error).__name__}: {error}", 1)
