"""kvbridge.transfer: the transfer engine.

Register memory, exchange metadata, connect, then submit batches of reads and writes::

    with TransferEngine("decode") as decode, TransferEngine("prefill") as prefill:
        dst = decode.register(decode_buffer, access="w")
        src = prefill.register(prefill_buffer, access="r")
        peer = prefill.connect(decode.metadata())
        peer.write([(src, 0, dst.id, 0, nbytes)], notify=b"req-17").wait()
        decode.notifications()  # [Notification(peer="prefill", message=b"req-17")]

Public surface: :class:`TransferEngine`, :class:`Peer`, :class:`Region`,
:class:`RegionInfo`, :class:`TransferHandle`, :class:`Notification`, :class:`Digests` (the
XXH3-64 of groups of a batch's bytes, taken as they move),
:class:`TransferSettings`, :data:`OP_DTYPE`, :class:`Caller` and :class:`Admission` (what a
request handler and a region guard are given and return), :class:`Principal` (whom an
engine answers, each with a secret: ``TransferEngine(principals=...)``), and the errors
(all :class:`TransferError`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy
from ._address import BadAddress, parse_address
from ._descriptors import MAX_STRANGERS, open_files_limit, raise_open_files, trusted_connections
from ._device import is_device
from ._errors import (
    AccessDenied,
    AuthenticationError,
    EngineClosed,
    LocalProtocolError,
    PeerClosed,
    RegionBusy,
    RemoteInternalError,
    RemoteProtocolError,
    StillInFlight,
    TransferError,
)
from ._protocol import APP_CODES, MAX_CONTROL_BYTES
from ._settings import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_STREAMS

if TYPE_CHECKING:
    from ._digests import Digests
    from ._engine import TRANSPORTS, Notification, TransferEngine
    from ._gate import Connection, ConnectionGate
    from ._handle import TransferHandle
    from ._keyring import DEFAULT_PRINCIPAL, Principal
    from ._nixl_agent import nixl_available
    from ._ops import OP_DTYPE
    from ._peer import Peer
    from ._regions import Admission, Region, RegionInfo
    from ._sessions import Caller
    from ._settings import TransferSettings
    from ._streams import NotifyRefused
    from ._ucx import ucx_available

_LAZY = {
    "TRANSPORTS": "._engine",
    "Notification": "._engine",
    "TransferEngine": "._engine",
    "Connection": "._gate",
    "ConnectionGate": "._gate",
    "TransferHandle": "._handle",
    "Digests": "._digests",
    "DEFAULT_PRINCIPAL": "._keyring",
    "Principal": "._keyring",
    "OP_DTYPE": "._ops",
    "Peer": "._peer",
    "Admission": "._regions",
    "Region": "._regions",
    "RegionInfo": "._regions",
    "Caller": "._sessions",
    "TransferSettings": "._settings",
    "NotifyRefused": "._streams",
    "nixl_available": "._nixl_agent",
    "ucx_available": "._ucx",
}
"""The engine (pyzmq, threads) loads on first use: the store's modules that need only a
wire constant or a check from here do not pay for it."""


__getattr__ = lazy(__name__, _LAZY, globals())


__all__ = [
    "APP_CODES",
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_PRINCIPAL",
    "DEFAULT_STREAMS",
    "MAX_CONTROL_BYTES",
    "MAX_STRANGERS",
    "OP_DTYPE",
    "TRANSPORTS",
    "AccessDenied",
    "Admission",
    "AuthenticationError",
    "BadAddress",
    "Caller",
    "Connection",
    "ConnectionGate",
    "Digests",
    "EngineClosed",
    "LocalProtocolError",
    "Notification",
    "NotifyRefused",
    "Peer",
    "PeerClosed",
    "Principal",
    "Region",
    "RegionBusy",
    "RegionInfo",
    "RemoteInternalError",
    "RemoteProtocolError",
    "StillInFlight",
    "TransferEngine",
    "TransferError",
    "TransferHandle",
    "TransferSettings",
    "is_device",
    "nixl_available",
    "open_files_limit",
    "parse_address",
    "raise_open_files",
    "trusted_connections",
    "ucx_available",
]
