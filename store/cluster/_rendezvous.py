"""Rendezvous (highest-random-weight) hashing: which cluster members own a block key.

Every member gets a weight per key, a hash of the two; the key's owners are the members
with the highest weights, in order. Every client computes the same owners from the same
membership, with no table to share. When a member leaves, only the keys it owned move
(each to its next-highest member); when one joins, it takes the keys where it now weighs
most, about ``1/N`` of them, from every other member alike.

The weight of key ``k`` on member ``m`` is ``mix(h(k) ^ s(m))``: ``h`` folds the key's
64-bit words together with XOR, after mixing each (a key is a 16- or 32-byte digest
already, BLAKE3, XXH3-128 or BLAKE2b: hashing it again buys nothing, and the fold is numpy
over a whole batch, where XXH3 of each key was a Python call per key, 0.2 ms of a 1,000-key
lookup), ``s`` is XXH3-64 of the member's name, and ``mix`` the SplitMix64 finaliser (a
bijection that spreads every input bit over the output), computed for a whole batch of
keys and members at once. (Before 2026-12-01 ``h`` was XXH3-64 of the key: clients of
both versions place keys differently, so a cluster's clients are upgraded together; a
block the other version placed is a miss, never a wrong byte.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

__all__ = ["Rendezvous"]

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    result: np.ndarray = x ^ (x >> np.uint64(31))
    return result


class Rendezvous:
    """Owners of keys among ``members`` (names, e.g. advertised addresses; order does not
    matter, duplicates are refused)."""

    def __init__(self, members: Sequence[str]) -> None:
        if len(set(members)) != len(members):
            raise ValueError(f"member names must be distinct: {sorted(members)}")
        self.members: tuple[str, ...] = tuple(sorted(members))
        self._salts = np.array(
            [xxhash.xxh3_64_intdigest(name.encode()) for name in self.members], dtype=np.uint64
        )

    def owners(self, keys: Sequence[bytes], replicas: int = 1) -> np.ndarray:
        """Per key, the indices (into ``members``) of its ``replicas`` owners, highest weight
        first: an ``int`` array of shape ``(len(keys), min(replicas, len(members)))``."""
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        count = min(replicas, len(self.members))
        if not keys or not count:
            return np.zeros((len(keys), count), dtype=np.int64)
        hashes = _key_hashes(keys)
        weights = _mix(hashes[:, None] ^ self._salts[None, :])
        if count == 1:
            best: np.ndarray = np.argmax(weights, axis=1)[:, None]
            return best
        order = np.argsort(weights, axis=1)[:, ::-1]
        return np.ascontiguousarray(order[:, :count])

    def owner_names(self, key: bytes, replicas: int = 1) -> list[str]:
        """The names of one key's owners, highest weight first."""
        return [self.members[i] for i in self.owners([key], replicas)[0]]


def _key_hashes(keys: Sequence[bytes]) -> np.ndarray:
    """Per key, its 64-bit words mixed and folded together with XOR (keys of one length
    at once; a call that mixes 16- and 32-byte keys is split by length)."""
    joined = b"".join(keys)
    for length in (32, 16):
        if len(joined) == length * len(keys):  # all of one length (the usual case)
            return _fold(np.frombuffer(joined, dtype="<u8").reshape(len(keys), length // 8))
    hashes = np.empty(len(keys), dtype=np.uint64)
    lengths = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
    for length in np.unique(lengths).tolist():
        at = np.flatnonzero(lengths == length)
        words = np.frombuffer(b"".join(keys[i] for i in at.tolist()), dtype="<u8")
        hashes[at] = _fold(words.reshape(len(at), -1))
    return hashes


def _fold(words: np.ndarray) -> np.ndarray:
    mixed = _mix(words.astype(np.uint64))
    folded: np.ndarray = np.bitwise_xor.reduce(mixed, axis=1)
    return folded
