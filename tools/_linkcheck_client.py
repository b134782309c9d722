"""The measuring side of ``kvbridge linkcheck``, run inside the first namespace.

``python -m kvbridge.tools._linkcheck_client METADATA_HEX HOST RAW_PORT SECONDS
REQUEST_BYTES BLOCK_BYTES STREAMS`` prints one JSON line: engine goodput and raw TCP
goodput (bytes/s, writes of 1 MiB blocks in batches of 64 MiB), and the times to write
three requests' KV cache (``REQUEST_BYTES`` in ``BLOCK_BYTES`` blocks).

With ``--loop`` first it instead answers commands on stdin, ``engine`` or ``raw``, each
moving one 64 MiB batch and printing ``done`` (for benchmarks that time rounds).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

import numpy as np

from kvbridge.tools._bench import RawLink
from kvbridge.tools._bench_wire import TOTAL, shuffled_offsets
from kvbridge.transfer import OP_DTYPE, TransferEngine

_BLOCK = 1 << 20
_BATCH_BLOCKS = 64


def main(argv: list[str]) -> None:
    loop = argv[:1] == ["--loop"]
    if loop:
        argv = argv[1:]
    metadata_hex, host, raw_port, seconds, request_bytes, block_bytes, streams = argv
    source = np.random.default_rng(0).integers(0, 256, TOTAL, dtype=np.uint8)
    with TransferEngine("linkcheck", streams=int(streams)) as engine:
        region = engine.register(source, access="r")
        peer = engine.connect(bytes.fromhex(metadata_hex))
        remote = next(iter(peer.regions))

        def write(block: int, count: int, seed: int) -> None:
            ops = np.zeros(count, OP_DTYPE)
            ops["local_region"], ops["remote_region"] = region.id, remote
            ops["local_offset"] = shuffled_offsets(block, count, seed + 1)
            ops["remote_offset"] = shuffled_offsets(block, count, seed)
            ops["length"] = block
            peer.write(ops).wait(600)

        write(_BLOCK, 4, 0)  # connection warm-up
        if loop:
            _serve_loop(write, RawLink(int(raw_port), int(streams), source.data, host))
            return
        goodput = _rate(lambda seed: write(_BLOCK, _BATCH_BLOCKS, seed), float(seconds))
        raw = RawLink(int(raw_port), int(streams), source.data, host)
        try:
            raw_goodput = _rate(lambda seed: raw.send(_BLOCK, _BATCH_BLOCKS, seed), float(seconds))
        finally:
            raw.close()
        block = int(block_bytes)
        count = max(1, int(request_bytes) // block)
        count = min(count, TOTAL // block)
        request_s = []
        for seed in range(3):
            start = time.perf_counter()
            write(block, count, seed)
            request_s.append(time.perf_counter() - start)
    print(
        json.dumps(
            {
                "goodput": goodput,
                "raw_goodput": raw_goodput,
                "request_s": request_s,
                "request_bytes": count * block,
            }
        ),
        flush=True,
    )


def _serve_loop(write: Callable[[int, int, int], None], raw: RawLink) -> None:
    print("ready", flush=True)
    try:
        for seed, line in enumerate(sys.stdin, 1):
            if line.strip() == "engine":
                write(_BLOCK, _BATCH_BLOCKS, seed)
            else:
                raw.send(_BLOCK, _BATCH_BLOCKS, seed)
            print("done", flush=True)
    finally:
        raw.close()


def _rate(batch: Callable[[int], None], seconds: float) -> float:
    """Bytes per second of back-to-back batches of ``_BATCH_BLOCKS`` blocks."""
    moved, start = 0, time.perf_counter()
    seed = 1
    while True:
        batch(seed)
        seed += 1
        moved += _BLOCK * _BATCH_BLOCKS
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and seed > 2:
            return moved / elapsed


if __name__ == "__main__":
    main(sys.argv[1:])
