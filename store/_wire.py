"""The cache server's request/reply messages: msgpack maps over the engine's ``call``.

Requests name an ``op``; store ops also carry ``ns`` (a namespace handle from ``open``).
Replies are maps; a refused request answers ``{"error": code, "kind": ..., "message": ...,
"keys": ...}`` and changed nothing. ``code`` (:data:`CODES`) names the :mod:`kvbridge.store`
error class, which the client raises again; ``kind`` and ``message`` are for people. A put's
commit that rides a write's notification is refused with the same code, as the write's
``TransferError.code``. ``InternalError`` means the server failed inside (its bug, logged
there with a traceback), never that the request was malformed.

=========  ===========================================  =====================================
op         request fields                               reply fields
=========  ===========================================  =====================================
open       namespace (bytes), block_bytes               ns, region, block_bytes, capacity,
                                                        lease_ttl, request_blocks
contains   ns, keys                                     present (bools)
match      ns, keys                                     count
room       ns, keys                                     new (keys not stored), room (blocks
                                                        the namespace can take now)
stage      ns, keys                                     lease, slots (int or nil), saved_bytes
commit     ns, lease, sums (optional: one XXH3-64 per  stored
           staged block, 0 for none: _checksums.py)
abort      ns, lease                                    (empty)
pin        ns, keys                                     lease, slots, sums (per key: its
                                                        writer's checksum, 0 for none)
verify     ns, keys (a reader found them corrupt)       dropped (bools: the stored copy was
                                                        bad too, and is gone)
release    ns, lease                                    (empty), or error LeaseExpired
remove     ns, keys                                     removed (bools)
clear      ns                                           removed (count)
events     ns                                           port, topic, ticket (the namespace's
                                                        event stream: EVENTS.md)
keys       ns, snapshot and offset (a later page)       snapshot, seq, keys, more (a page of a
                                                        snapshot of the namespace's keys)
stats      (none)                                       server, namespaces, engine
=========  ===========================================  =====================================
"""

from __future__ import annotations

from typing import Any

from ..transfer import APP_CODES
from ._errors import (
    BlockCorrupt,
    BlockNotFound,
    BlockPinned,
    InvalidKey,
    LeaseExpired,
    StoreClosed,
    StoreError,
    StoreFull,
)
from ._keys import KEY_LENGTHS, validate_key

DEFAULT_PORT = 7600
"""Where a cache server listens for control requests unless told otherwise."""

MAX_KEYS_PER_REQUEST = 16384
"""Keys in one request: 16,384 keys of 32 bytes are 0.5 MiB, inside the 1 MiB control limit."""


class BadRequest(StoreError, ValueError):
    """The server could not make sense of a request (a client bug, or not a client)."""


class TooManyRequests(StoreError):
    """This client holds as many open leases as the server allows; release some first."""


class UnknownNamespace(StoreError, LookupError):
    """The request names a namespace handle the server does not have, or one this session
    did not open."""


class NotPermitted(StoreError, PermissionError):
    """The session's tenant may not do this: open a namespace outside its prefixes, or
    write as a read-only tenant (``store/server/_tenants.py``)."""


class InternalError(StoreError):
    """The server failed inside while answering (a bug, logged there with its traceback);
    the request may or may not have taken effect."""


CODES: dict[type[StoreError], int] = {
    cls: APP_CODES + number
    for number, cls in enumerate(
        (
            BadRequest,
            BlockNotFound,
            BlockPinned,
            InvalidKey,
            LeaseExpired,
            StoreClosed,
            StoreFull,
            TooManyRequests,
            UnknownNamespace,
            InternalError,
            NotPermitted,
            BlockCorrupt,
        ),
        start=1,
    )
}
"""The wire code of each error kind (stable: append new kinds, never renumber)."""

ERRORS: dict[int, type[StoreError]] = {code: cls for cls, code in CODES.items()}


def code_of(exc: StoreError) -> int:
    """The wire code of ``exc`` (its nearest listed class; ``InternalError`` if none)."""
    for cls in type(exc).__mro__:
        if cls in CODES:
            return CODES[cls]
    return CODES[InternalError]


def error_reply(exc: StoreError) -> dict[str, Any]:
    reply: dict[str, Any] = {
        "error": code_of(exc),
        "kind": type(exc).__name__,
        "message": str(exc),
    }
    keys = getattr(exc, "keys", None)
    if keys is not None:
        reply["keys"] = list(keys)[:MAX_KEYS_PER_REQUEST]
    return reply


def error_for(code: int | None, message: str, keys: list[bytes] | None = None) -> StoreError:
    """The store error a wire code stands for (``InternalError`` for an unknown code)."""
    cls = ERRORS.get(code, InternalError) if isinstance(code, int) else InternalError
    if cls in (BlockNotFound, BlockPinned, BlockCorrupt):
        return cls(keys or [])
    return cls(message)


def raise_error(reply: dict[str, Any]) -> None:
    """Raise the error a reply carries, as the server raised it."""
    code = reply.get("error")
    if code is None:
        return
    keys = [bytes(k) for k in reply.get("keys", []) if isinstance(k, bytes)]
    raise error_for(code, str(reply.get("message", reply.get("kind", code))), keys)


def field(message: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = message.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise BadRequest(f"field {name!r} is missing or not {getattr(kind, '__name__', kind)}")
    return value


def optional_field(message: dict[str, Any], name: str, kind: type) -> Any:
    """:func:`field` for a field that may be left out (``None`` then)."""
    return None if message.get(name) is None else field(message, name, kind)


def keys_field(message: dict[str, Any]) -> list[bytes]:
    keys: list[bytes] = field(message, "keys", list)
    if len(keys) > MAX_KEYS_PER_REQUEST:
        raise BadRequest(f"{len(keys)} keys in one request; at most {MAX_KEYS_PER_REQUEST}")
    for key in keys:
        if type(key) is not bytes or len(key) not in KEY_LENGTHS:
            validate_key(key)  # raises InvalidKey naming it
    return keys
