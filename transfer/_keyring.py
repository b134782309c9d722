"""Principals: who may open a session with an engine, and what proves it.

An engine that answers handshakes knows one secret per principal (a cache server's
tenants); an engine that connects names the principal it speaks for and proves that it
knows that principal's secret (see ``_control``: the principal's name is part of every
proof, of the ticket and of the session key, so it cannot be swapped in flight). A session
carries its principal (``Caller.principal``) for the application to decide what it may do
and to count what it holds.

An engine given a single shared secret has one principal, :data:`DEFAULT_PRINCIPAL`, with
that secret; an engine without a secret has that one principal with no proof at all (the
loopback mode). A principal the keyring does not know is refused exactly as a wrong secret
is: the answer does not tell whether the name exists.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from ._errors import AuthenticationError, LocalProtocolError

DEFAULT_PRINCIPAL = ""
"""The principal of an engine with one shared secret (or none), and of its peers."""

MAX_SESSIONS_PER_PRINCIPAL = 4096
"""Sessions one principal may have at once unless its entry says less (the table's size)."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class Principal:
    """A party that may open sessions: its ``name``, its ``secret`` (``None`` only for the
    default principal of an engine without a secret), and how many sessions it may have
    at once."""

    name: str
    secret: bytes | None
    max_sessions: int = MAX_SESSIONS_PER_PRINCIPAL
    max_streams: int | None = None
    """Data streams its sessions may have open together (``None``: only the engine's own
    bound): a principal that opens many cannot take every stream the engine serves."""

    def __post_init__(self) -> None:
        check_principal(self.name)
        if self.secret is not None and (not isinstance(self.secret, bytes) or not self.secret):
            raise LocalProtocolError(f"principal {self.name!r}: a secret is non-empty bytes")
        if self.secret is None and self.name != DEFAULT_PRINCIPAL:
            raise LocalProtocolError(f"principal {self.name!r} needs a secret")
        if isinstance(self.max_sessions, bool) or not isinstance(self.max_sessions, int):
            raise LocalProtocolError(f"principal {self.name!r}: max_sessions is a whole number")
        if self.max_sessions < 1:
            raise LocalProtocolError(f"principal {self.name!r}: max_sessions must be at least 1")
        streams = self.max_streams
        if streams is not None and (isinstance(streams, bool) or not isinstance(streams, int)):
            raise LocalProtocolError(f"principal {self.name!r}: max_streams is a whole number")
        if streams is not None and streams < 1:
            raise LocalProtocolError(f"principal {self.name!r}: max_streams must be at least 1")


def check_principal(name: object) -> str:
    """``name`` if it is a principal's name: the default (empty), or 1-64 letters, digits,
    ``.``, ``_``, ``-``, starting with a letter or digit."""
    if not isinstance(name, str) or (name != DEFAULT_PRINCIPAL and not _NAME.match(name)):
        raise LocalProtocolError(
            f"a principal is 1-64 letters, digits, '.', '_' or '-' (or empty), got {name!r}"
        )
    return name


class Keyring:
    """The principals an engine answers handshakes for."""

    def __init__(self, principals: Iterable[Principal]) -> None:
        self._by_name: dict[str, Principal] = {}
        for principal in principals:
            if principal.name in self._by_name:
                raise LocalProtocolError(f"principal {principal.name!r} is named twice")
            self._by_name[principal.name] = principal
        if not self._by_name:
            raise LocalProtocolError("a keyring needs at least one principal")
        open_ = [p.name for p in self._by_name.values() if p.secret is None]
        if open_ and len(self._by_name) > 1:
            raise LocalProtocolError("an engine without a secret has one principal only")
        self.secured = not open_
        """Whether a handshake must prove a secret (every principal has one)."""
        self._decoy = secrets.token_bytes(32)  # the "secret" of names nobody holds

    @classmethod
    def shared(cls, secret: bytes | None) -> Keyring:
        """One principal, :data:`DEFAULT_PRINCIPAL`, with ``secret`` (or none)."""
        return cls([Principal(DEFAULT_PRINCIPAL, secret)])

    def secret(self, principal: str) -> bytes | None:
        """The secret a proof for ``principal`` is made with: a random one, never held by
        anyone, for a name this keyring does not know (so its proofs never check out)."""
        known = self._by_name.get(principal)
        if known is None:
            return self._decoy if self.secured else b""
        return known.secret

    def admit(self, principal: str) -> Principal:
        """The principal a verified handshake speaks for; :class:`AuthenticationError` for
        a name this keyring does not know (worded as a wrong secret)."""
        known = self._by_name.get(principal)
        if known is None:
            raise AuthenticationError("wrong shared secret")
        return known

    def max_sessions(self, principal: str) -> int:
        known = self._by_name.get(principal)
        return MAX_SESSIONS_PER_PRINCIPAL if known is None else known.max_sessions

    def max_streams(self, principal: str) -> int | None:
        known = self._by_name.get(principal)
        return None if known is None else known.max_streams
