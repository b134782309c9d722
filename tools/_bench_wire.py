"""What ``kvbridge bench`` and its target process share: buffer size, block placement and the
raw-socket baseline's header."""

from __future__ import annotations

import struct
import subprocess
import sys
from typing import IO

import numpy as np

TOTAL = 256 << 20
RAW_HEADER = struct.Struct("<QQQIIB")
READY = "KVBRIDGE-BENCH-TARGET"
"""Prefix of the target's one line of output (UCX may print warnings to stdout first)."""


def shuffled_offsets(block: int, count: int, seed: int) -> np.ndarray:
    """Offsets of ``count`` distinct blocks scattered over the buffer (same on both sides).

    Slot ``i`` is ``(start + i * stride) mod slots`` with an odd stride near the golden
    ratio of the slot count: a permutation (slot counts are powers of two), no two
    neighbours adjacent, and O(count) to compute (a random permutation of 65,536 slots cost
    1.5 ms, which showed up in per-batch latencies of small batches)."""
    slots = TOTAL // block
    stride = int(slots * 0.6180339887) | 1
    start = (seed * 2654435761) % slots
    index = (start + np.arange(count, dtype=np.int64) * stride) % slots
    return index * block


def read_ready(stdout: IO[str]) -> tuple[str, int]:
    """The target's engine metadata (hex) and raw port, skipping lines that are not ours."""
    for line in stdout:
        if line.startswith(READY):
            _, metadata_hex, port = line.split()
            return metadata_hex, int(port)
    raise RuntimeError("the bench target exited before it was ready")


def target_argv(*args: str) -> list[str]:
    """The command line of a target process (``kvbridge.tools._bench_target ARGS``)."""
    return [sys.executable, "-m", "kvbridge.tools._bench_target", *args]


def start_target(argv: list[str], *, quiet: bool = False) -> subprocess.Popen[str]:
    """Start a target (``argv``: :func:`target_argv`, maybe wrapped to run elsewhere) with
    pipes on stdin, to stop it, and stdout, for :func:`read_ready`; ``quiet`` drops stderr."""
    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL if quiet else None,
        text=True,
    )


def stop_target(target: subprocess.Popen[str]) -> None:
    """Close the target's stdin (its signal to stop) and wait for it; kill it if stuck."""
    if target.stdin is not None:
        target.stdin.close()
    try:
        target.wait(30)
    except subprocess.TimeoutExpired:
        target.kill()
        target.wait()
