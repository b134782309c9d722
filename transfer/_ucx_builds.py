"""One UCX build per process: ucxx's (the ``ucx`` transport) or NIXL's (``nixl``).

Each wheel brings a UCX of its own (``libucx-cu12`` 1.21 for ucxx; NIXL 1.5.1 bundles
another, renamed), and the two do not share a process: with NIXL agents made first, the
``ucx`` transport's worker thread crashed the process (SIGSEGV) when a server it read from
was killed, every time in three runs of ``tests/test_nixl.py`` and ``test_server_death.py
-k ucx`` together. The first transport an engine starts claims the process for its build;
the other is then refused with a :class:`LocalProtocolError` that says so (run it in a
process of its own)."""

from __future__ import annotations

import threading

from ._errors import LocalProtocolError

_lock = threading.Lock()
_claimed: str | None = None


def claim(transport: str) -> None:
    """Take this process's UCX for ``transport`` (``ucx`` or ``nixl``), or refuse."""
    global _claimed
    with _lock:
        if _claimed is None:
            _claimed = transport
        elif _claimed != transport:
            raise LocalProtocolError(
                f"the {transport} transport cannot run in a process where the {_claimed} "
                "transport ran: their UCX libraries clash (NIXL's and ucxx's); run it in a "
                "process of its own"
            )


def free_for(transport: str) -> bool:
    """Whether ``transport`` may still take this process's UCX."""
    with _lock:
        return _claimed in (None, transport)
