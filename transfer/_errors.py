"""Typed errors of the transfer engine.

As in h11, the two protocol errors say who was wrong: :class:`LocalProtocolError` means our
caller misused the API (nothing was sent), :class:`RemoteProtocolError` means the peer sent
something illegal (its connection is failed, other peers are unaffected). They are raised
at one boundary each: argument checks in the engine, the parser in ``_protocol``.
"""

from __future__ import annotations


class TransferError(Exception):
    """A batch failed: the message says which op and why (``op_index`` when known).

    ``code`` is the refusal's code when the peer refused (an ``ErrorCode``, or from 1000 up
    an application's own, such as a cache server's store error kinds): match on it, never
    on the message."""

    def __init__(
        self, message: str, *, op_index: int | None = None, code: int | None = None
    ) -> None:
        super().__init__(message)
        self.op_index = op_index
        self.code = code


class LocalProtocolError(TransferError, ValueError):
    """The caller asked for something illegal (bad op, region, size, state); nothing moved."""


class RemoteProtocolError(TransferError):
    """The peer broke the wire protocol; that connection is failed for good."""


class AccessDenied(TransferError):
    """A remote op named an unknown region, a wrong access key, an access the region does
    not allow, or bytes outside it; it was rejected before any byte was written."""


class AuthenticationError(TransferError):
    """The peer failed (or did not attempt) the shared-secret handshake."""


class RemoteInternalError(TransferError):
    """The peer failed inside while answering (its bug, logged on its side); the request may
    or may not have taken effect there."""


class StillInFlight(TransferError):
    """A batch failed (its deadline passed, or its peer is gone) but its transport could not
    stop it: bytes may still land in its local memory (a read) or be taken from it (a
    write) later. The ``nixl`` transport over UCX TCP, where NIXL cannot cancel a one-sided
    op once posted. The batch's local regions stay busy for the engine's life
    (``unregister`` raises :class:`RegionBusy`): do not reuse that memory for anything
    whose bytes matter."""


class RegionBusy(TransferError):
    """A region cannot be unregistered while a transfer uses it."""


class PeerClosed(TransferError):
    """The connection to the peer is gone (closed, killed, timed out); reconnect to go on."""


class EngineClosed(TransferError, RuntimeError):
    """The engine has been closed."""
