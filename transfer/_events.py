"""What a data stream's :class:`~kvbridge.transfer._protocol.Connection` yields: one event
per frame it has read the framing bytes of."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Ack", "Data", "Error", "Event", "Hello", "Notify", "Ping", "Pong", "Read", "Write"]


@dataclass(frozen=True)
class Hello:
    token: bytes
    stream: int


@dataclass(frozen=True)
class Write:
    request_id: int
    ops: np.ndarray
    payload_bytes: int


@dataclass(frozen=True)
class Read:
    request_id: int
    ops: np.ndarray


@dataclass(frozen=True)
class Notify:
    request_id: int
    message: bytes


@dataclass(frozen=True)
class Ack:
    request_id: int


@dataclass(frozen=True)
class Data:
    request_id: int
    payload_bytes: int


@dataclass(frozen=True)
class Ping:
    request_id: int


@dataclass(frozen=True)
class Pong:
    request_id: int


@dataclass(frozen=True)
class Error:
    request_id: int
    op_index: int | None
    code: int
    message: str


Event = Hello | Write | Read | Notify | Ack | Data | Error | Ping | Pong
