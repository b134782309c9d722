"""The link the demo's figures are measured against: raw TCP between two processes, with as
many streams as the transfer engine opens to a peer, ``sendall`` of 1 MiB blocks."""

from __future__ import annotations

import time

import numpy as np

from kvbridge.transfer import TransferSettings

from ._bench import RawLink
from ._bench_wire import TOTAL, read_ready, start_target, stop_target, target_argv

_BLOCK = 1 << 20
_BATCH = 64


def link_speed(streams: int | None = None, seconds: float = 1.0) -> float:
    """Bytes per second of ``streams`` raw TCP connections from this process into a sink
    process on loopback (the shape of a worker pushing to ``kvbridge serve``); ``None`` is
    the engine's default stream count.

    Raises ``OSError`` or ``RuntimeError`` when the sink cannot be started or drops a stream.
    """
    streams = TransferSettings().streams if streams is None else streams
    sink = start_target(target_argv(str(streams), "tcp"), quiet=True)
    try:
        assert sink.stdout is not None
        _, port = read_ready(sink.stdout)
        source = np.random.default_rng(0).integers(0, 256, TOTAL, dtype=np.uint8)
        link = RawLink(port, streams, source.data)
        try:
            link.send(_BLOCK, 4, 0)  # warm-up: connections and page faults
            return _rate(link, seconds)
        finally:
            link.close()
    finally:
        stop_target(sink)


def _rate(link: RawLink, seconds: float) -> float:
    moved, start, seed = 0, time.perf_counter(), 1
    while True:
        link.send(_BLOCK, _BATCH, seed)
        moved += _BLOCK * _BATCH
        seed += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and seed > 3:
            return moved / elapsed
