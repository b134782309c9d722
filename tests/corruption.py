"""Damage on purpose, as a stray write, a failing DIMM or a bad disk sector would: bytes
overwritten in place in another process's memory (through ``/proc/PID/mem``, as root or
its owner) or in a file, found by what they hold, or a bit flipped in an in-process
server's memory slot."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvbridge.store import BlockKey
from kvbridge.store.local import SlotTier

if TYPE_CHECKING:
    from kvbridge.store.server._namespaces import Namespace

_LARGEST_REGION = 1 << 30
"""Mappings larger than this are address-space reservations, not a small server's data."""


def overwrite_in_memory(pid: int, needle: bytes, garbage: bytes) -> int:
    """Overwrite every copy of ``needle`` in the writable memory of process ``pid`` with
    ``garbage`` (from the copy's first byte on); how many copies there were."""
    found = 0
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as memory:
        for start, end in _writable(pid):
            memory.seek(start)
            try:
                data = memory.read(end - start)
            except OSError:  # a mapping the kernel will not let us read (vvar, guard pages)
                continue
            at = data.find(needle)
            while at >= 0:
                memory.seek(start + at)
                memory.write(garbage)
                found += 1
                at = data.find(needle, at + len(needle))
    return found


def flip_stored_bit(ns: Namespace, key: bytes, at: int) -> None:
    """Flip one bit of the block ``key`` in place, in the memory slot of an in-process
    server's namespace (``serve.namespaces``) that holds it."""
    top = ns.store.placement.tiers[0]
    assert isinstance(top, SlotTier)
    top.view(BlockKey(key))[at] ^= 0x01


def overwrite_in_files(root: Path, needle: bytes, garbage: bytes) -> int:
    """Overwrite every copy of ``needle`` in the files under ``root``; how many there were."""
    found = 0
    for path in [p for p in root.rglob("*") if p.is_file()]:
        data = bytearray(path.read_bytes())
        at = data.find(needle)
        while at >= 0:
            data[at : at + len(garbage)] = garbage
            found += 1
            at = data.find(needle, at + len(needle))
        path.write_bytes(bytes(data))
    return found


def _writable(pid: int) -> list[tuple[int, int]]:
    regions = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        start, end = (int(x, 16) for x in span.split("-"))
        if perms.startswith("rw") and end - start <= _LARGEST_REGION:
            regions.append((start, end))
    return regions
