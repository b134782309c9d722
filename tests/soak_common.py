"""The soak test's shared ground: its settings, and block keys and bytes as pure functions
(so any process can check any block it reads)."""

from __future__ import annotations

import hashlib
import os

import numpy as np

from kvbridge.store import (
    BlockKey,
)

BB = 64 << 10
NAMESPACES = ("soak-a", "soak-b")
HOST_CAPACITY = 8 << 20
"""64 blocks per namespace (the server splits it between ``--max-namespaces 2``)."""
LEASE_TTL = 2.0
CONVERSATIONS = 2048
BLOCKS = 16
"""Keys of a namespace: prefixes of ``CONVERSATIONS`` conversations of ``BLOCKS`` blocks
(32768 keys, 2 GiB): enough that puts keep sending new blocks for the whole run."""
DISK_CAPACITY = 2 * len(NAMESPACES) * CONVERSATIONS * BLOCKS * BB
"""Twice every key the workers can write (each namespace gets half): the disk tier never
evicts, so a committed block can never legitimately leave the store."""
WORKERS = 8
CLIENT_TIMEOUT_S = 10.0
KILL_EVERY_S = (2.0, 4.0)
STOP_GRACE_S = 30.0
"""How long workers get, past the deadline, to finish their operation and exit."""
SETTLE_S = 30.0
"""How long the server's threads get, once every client left, to end (a slow-loris
connection's thread ends at the 10 s handshake deadline at the latest)."""
LEASES_GONE_S = 5.0
"""How long the server gets, once every client left, to hold no lease."""
RSS_SLACK_BYTES = 64 << 20
LORIS_CONNECTIONS = 16
LORIS_MAX_AGE_S = 20.0
"""The server's handshake deadline is 10 s (connect_timeout): a slow-loris connection that
lives much longer than that holds a serving thread without a deadline."""


def soak_seconds() -> float:
    return float(os.environ.get("KVBRIDGE_SOAK_S", "15"))


# -- keys and bytes: pure functions of (namespace, conversation, block) -------------------


def block_key(ns: str, conversation: int, block: int) -> BlockKey:
    text = f"{ns}/{conversation}/{block}".encode()
    return BlockKey(hashlib.blake2b(text, digest_size=32).digest())


def prefix(ns: str, conversation: int, length: int) -> list[BlockKey]:
    return [block_key(ns, conversation, i) for i in range(length)]


def block_bytes(key: bytes) -> np.ndarray:
    """The only bytes ever committed under ``key``: blake2b(key) expanded by PCG64."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=16).digest(), "little")
    generator = np.random.Generator(np.random.PCG64(seed))
    return np.frombuffer(generator.bytes(BB), dtype=np.uint8)


def blocks_of(keys: list[BlockKey]) -> np.ndarray:
    out = np.empty((len(keys), BB), dtype=np.uint8)
    for row, key in zip(out, keys, strict=True):
        row[:] = block_bytes(key)
    return out


def wrong_bytes(keys: list[BlockKey], out: np.ndarray) -> list[tuple[int, int]]:
    """(index, wrong byte count) of each block of ``out`` that is not its key's bytes."""
    bad = []
    for i, key in enumerate(keys):
        wrong = int(np.count_nonzero(out[i] != block_bytes(key)))
        if wrong:
            bad.append((i, wrong))
    return bad
