"""The process's open-files limit: raised at a server's start, and shared out among ports.

Every connection a server holds is a descriptor, and the usual soft limit (1,024) is far
below the usual hard one. A server raises its soft limit to the hard one at start (as
vLLM and ``kvbridge proxy`` do) and logs what it got. Each listening port then caps the
connections of peers that proved nothing (:data:`MAX_STRANGERS` silent ones on a control
or events port, four times that in all: ``_gate``; the data and metrics ports have caps of
their own, 64 each), and the rest stays for peers that did (:func:`trusted_connections`).
"""

from __future__ import annotations

import logging

MAX_STRANGERS = 64
"""Connections of a ZMQ port not yet past a handshake or a ticket, at once; the quietest
goes past it. An honest peer proves itself within a round trip of connecting."""

_TRUSTED_SHARE = 4
"""Trusted connections of one ZMQ port may take a quarter of the open-files limit."""
_MIN_TRUSTED = 64

_log = logging.getLogger("kvbridge.transfer")


def open_files_limit() -> int | None:
    """The soft open-files limit, or ``None`` where there is none (or no ``resource``)."""
    try:
        import resource  # noqa: PLC0415  (POSIX only)
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def raise_open_files(wanted: int | None = None) -> int | None:
    """Raise the soft open-files limit to ``wanted`` (``None``: the hard limit), never
    above the hard limit and never down; warn when it cannot. Returns the limit in force
    (``None``: unlimited, or not a POSIX system) for the caller to log."""
    try:
        import resource  # noqa: PLC0415  (POSIX only)
    except ImportError:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if wanted is None else wanted
    if hard != resource.RLIM_INFINITY:
        target = min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            _log.warning("cannot raise the open-files limit from %d to %d: %s", soft, target, exc)
    return open_files_limit()


def trusted_connections() -> int:
    """How many trusted connections one ZMQ port may hold (see the module's docstring)."""
    limit = open_files_limit()
    if limit is None:
        return 1 << 20
    return max(_MIN_TRUSTED, limit // _TRUSTED_SHARE)
