"""Shared test helpers: keys and block payloads that are pure functions of an index."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from kvbridge.store import BlockKey


def free_port() -> int:
    """A loopback port nothing listens on (a server may take it a moment later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def key(i: int, size: int = 32) -> BlockKey:
    """A distinct, deterministic key for index ``i``."""
    return BlockKey(hashlib.blake2b(str(i).encode(), digest_size=size).digest())


def keys(start: int, stop: int) -> list[BlockKey]:
    return [key(i) for i in range(start, stop)]


def payload(k: bytes, block_bytes: int) -> np.ndarray:
    """The bytes stored under ``k`` in tests: a pure function of the key."""
    seed = int.from_bytes(k[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, block_bytes, dtype=np.uint8)


def payloads(ks: Sequence[bytes], block_bytes: int) -> np.ndarray:
    """One contiguous ``(len(ks), block_bytes)`` array of the keys' payloads."""
    out = np.empty((len(ks), block_bytes), dtype=np.uint8)
    for row, k in zip(out, ks, strict=True):
        row[:] = payload(k, block_bytes)
    return out


class FakeClock:
    """A clock for stores and leases that moves only when a test says so (no sleeps)."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def until(
    check: Callable[[], bool],
    what: str = "condition",
    timeout: float = 20.0,
    pause: float = 0.02,
) -> float:
    """Wait for ``check()`` to hold, looking every ``pause`` s; the seconds it took. Fails
    the test past ``timeout`` (a bound on the wait, never what a test asserts), saying
    ``what``."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < timeout, f"not in {timeout:.1f} s: {what}"
        time.sleep(pause)
    return time.monotonic() - start


def spawn_python(script: str, *args: str) -> subprocess.Popen[str]:
    """``python -c script args...`` with pipes to its stdin and stdout (text)."""
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def reap(proc: subprocess.Popen[str]) -> None:
    """Kill ``proc`` if it still runs (a stopped one too) and wait for it."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.wait(30)


def listening_sockets() -> set[int]:
    """The inodes of this process's listening TCP sockets (``/proc``: Linux)."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own descriptor
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                mine.add(int(target[len("socket:[") : -1]))
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                listening.add(int(fields[9]))
    return mine & listening
