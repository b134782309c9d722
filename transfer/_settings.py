"""Transfer settings: every limit named, with the reason for its default."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ._errors import LocalProtocolError
from ._protocol import KEEPALIVE_MISSES, MAX_PAYLOAD_BYTES, MIN_KEEPALIVE_MS

DEFAULT_STREAMS = 2
"""TCP streams per peer. Raw Python sockets on the 2-core development machine, 1 MiB sends:
1 stream 2.2 GB/s, 2 streams 3.6, 4 streams 3.6 (16 KiB: 1.2 / 1.8 / 1.6). More streams
help where there are more cores; set ``streams=`` to match the machine."""

DEFAULT_SLICE_BYTES = 1 << 20
"""Ops longer than this are cut so that the streams share them. 256 KiB slices gave the
same 1 MiB-op throughput within noise (3.15 against 3.24 GB/s); 4 MiB slices spread a
4 MiB op over one stream only."""

DEFAULT_FRAME_BYTES = 16 << 20
"""A frame (one header, one ACK) carries up to this many payload bytes; a batch is also cut
into at least one frame per stream. Measured with 1 MiB ops, 2 streams, two processes:
1 MiB frames 2.73 GB/s, 4 MiB 3.09-3.24, 16 MiB 3.51, 32 MiB 3.54. Per-frame costs (header
parse, region checks, ACK, two thread wake-ups) are what larger frames amortise."""

DEFAULT_TIMEOUT_S = 30.0
"""A batch not done after this long fails, and the peer's streams are closed: far longer
than moving any sane batch, short enough that a hung peer is noticed."""

DEFAULT_CONNECT_TIMEOUT_S = 10.0
"""Handshake and stream set-up must finish within this."""

DEFAULT_KEEPALIVE_S = 5.0
"""An engine asks the peers whose streams it serves for a frame this often, a PING when
they have nothing else to send, and closes a stream silent for ``KEEPALIVE_MISSES`` (3)
intervals: a peer that died or froze without closing its streams (killed over UCX shared
memory, a host gone from a TCP link, a stopped process) loses them, and with them its
session and leases, within 15 s. Each idle stream then costs a 24-byte PING and PONG every
5 s (a thousand idle streams: 200 of each a second); a busy stream sends none. Shorter
bounds cost more wake-ups; TCP's own keepalive would notice neither a frozen peer nor a UCX
one."""


@dataclass(frozen=True)
class TransferSettings:
    streams: int = DEFAULT_STREAMS
    slice_bytes: int = DEFAULT_SLICE_BYTES
    frame_bytes: int = DEFAULT_FRAME_BYTES
    timeout: float = DEFAULT_TIMEOUT_S
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S
    data_port: int = 0
    """Port of the TCP data listener (0: any free port)."""
    socket_buffer: int = 0
    """SO_SNDBUF/SO_RCVBUF in bytes; 0 keeps the kernel's autotuning."""
    keepalive: float = DEFAULT_KEEPALIVE_S
    """Keepalive interval asked of the peers of served streams (s); 0 turns it off."""

    def __post_init__(self) -> None:
        if not 1 <= self.streams <= 64:
            raise LocalProtocolError(f"streams must be 1..64, got {self.streams}")
        if not 4096 <= self.slice_bytes <= self.frame_bytes <= MAX_PAYLOAD_BYTES:
            raise LocalProtocolError("need 4096 <= slice_bytes <= frame_bytes <= 1 GiB")
        if self.timeout <= 0 or self.connect_timeout <= 0:
            raise LocalProtocolError("timeouts must be positive")
        if self.keepalive and not MIN_KEEPALIVE_MS / 1000 <= self.keepalive <= 86400:
            raise LocalProtocolError("keepalive must be 0 (off) or 0.05 to 86400 s")

    @property
    def silence_limit(self) -> float | None:
        """How long a served stream may send nothing before it is closed (None: for ever)."""
        return self.keepalive * KEEPALIVE_MISSES if self.keepalive else None

    @classmethod
    def from_kwargs(cls, settings: dict[str, Any]) -> TransferSettings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise LocalProtocolError(f"unknown settings {unknown}; known: {sorted(known)}")
        return cls(**settings)
