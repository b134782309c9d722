"""Building a TieredStore's tiers from its settings, every setting checked first."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Literal

from .._keys import namespace_bytes
from .._sizes import parse_size, positive_int
from ._policy import EvictionPolicy, make_policy
from ._slab import DeviceSlab, HostSlab
from ._slots import SlotTier
from ._tier import Tier
from .disk._tier import DiskTier, blocks_within

PolicySpec = str | Callable[[], EvictionPolicy]
DiskBound = Literal["blocks", "files"]
"""What ``disk_capacity`` bounds: the blocks' bytes, or the disk tier's files (LMDB's pages
and records, and one transaction's room, included: fewer blocks fit)."""


def build_tiers(
    block_bytes: int,
    *,
    host_capacity: int | str,
    disk_path: str | os.PathLike[str] | None,
    disk_capacity: int | str,
    disk_bound: DiskBound,
    device_capacity: int | str,
    device_id: int,
    policy: PolicySpec,
    namespace: bytes | str,
    disk_sync: bool,
    pin_host_memory: bool | Literal["auto"],
    prefault: bool,
) -> list[Tier]:
    """The tiers, highest first (device, host, disk; those with a capacity). Every setting
    is checked before anything is allocated; tiers already made are closed on a failure."""
    positive_int("block_bytes", block_bytes)
    make_policy(policy)  # reject an unknown name before allocating anything
    device_slots = _slots("device_capacity", device_capacity, block_bytes)
    host_slots = _slots("host_capacity", host_capacity, block_bytes)
    disk_blocks = _slots("disk_capacity", disk_capacity, block_bytes)
    if disk_bound == "files" and disk_blocks:
        disk_blocks = _files_blocks(parse_size(disk_capacity), block_bytes)
    elif disk_bound not in ("files", "blocks"):
        raise ValueError(f"disk_bound must be 'blocks' or 'files', got {disk_bound!r}")
    if disk_path is not None and not disk_blocks:
        raise ValueError("disk_path needs a disk_capacity of at least one block")
    if disk_blocks and disk_path is None:
        raise ValueError("disk_capacity needs a disk_path")
    ns = namespace_bytes(namespace)

    tiers: list[Tier] = []
    try:
        if device_slots:
            memory = DeviceSlab(device_slots, block_bytes, device_id=device_id)
            tiers.append(SlotTier("device", memory, make_policy(policy)))
        if host_slots:
            slab = HostSlab(host_slots, block_bytes, pin=pin_host_memory, prefault=prefault)
            tiers.append(SlotTier("host", slab, make_policy(policy)))
        if disk_path is not None:
            disk = DiskTier(
                disk_path,
                block_bytes,
                disk_blocks,
                policy=make_policy(policy),
                namespace=ns,
                sync=disk_sync,
            )
            tiers.append(disk)
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers


def _slots(what: str, capacity: int | str, block_bytes: int) -> int:
    size = parse_size(capacity)
    if 0 < size < block_bytes:
        raise ValueError(f"{what}={capacity!r} is smaller than one block ({block_bytes} bytes)")
    return size // block_bytes


def _files_blocks(max_bytes: int, block_bytes: int) -> int:
    blocks = blocks_within(max_bytes, block_bytes)
    if not blocks:
        raise ValueError(
            f"disk_capacity={max_bytes} bytes of files hold no {block_bytes}-byte block "
            "beside LMDB's records and room (about 1.3 MiB)"
        )
    return blocks
