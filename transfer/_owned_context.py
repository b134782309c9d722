"""A ZMQ context that only its owner ends."""

from __future__ import annotations

import warnings
from typing import Any

import zmq


class OwnedContext(zmq.Context[Any]):
    """A ZMQ context that ends only by its owner's ``term`` (an engine's ``close``).

    pyzmq destroys a context that is garbage-collected unclosed. An engine nobody closed is
    collected as one reference cycle with its context and sockets, and the collector clears
    the context's weak references to its sockets before any finalizer runs: ``destroy``
    closes none of them, and its ``term`` then waits for ever, in whatever thread the
    collection happened to run (in CI: a thread being started, so that its ``start`` never
    returned). Collected unclosed, this context warns and is left to the process; its
    sockets close as they are collected. A leak, where pyzmq's way is a hang."""

    def __del__(self) -> None:
        if not self.closed:
            warnings.warn(
                f"{self!r} was not terminated: an engine was never closed",
                ResourceWarning,
                stacklevel=2,
            )
