"""The fast path of a small batch: a few short ops, checked and planned with plain integers.

The vectorised path (``_ops``) costs about 100 us whatever the batch's size (numpy calls of
a few microseconds each: normalise, check every region's bounds, merge, slice, pack), which
is most of one small op's latency. A batch of at most :data:`SMALL_OPS` ops that fits in one
slice (``slice_bytes``) needs none of that: no op is cut, and the whole batch is one frame.
This path checks exactly what ``_ops.check`` checks, with the same errors, and returns the
frame ``_ops.plan`` would (without merging adjacent ops: the same bytes, one descriptor each).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ._errors import LocalProtocolError
from ._ops import OP_DTYPE, FramePlan, normalize
from ._protocol import DESCRIPTOR, SMALL_OPS
from ._regions import Region, RegionInfo, RegionTable

_ORIGINS = [np.arange(n) for n in range(SMALL_OPS + 1)]

Rows = list[tuple[int, int, int, int, int]]
"""A small batch as plain integers: ``(local_region, local_offset, remote_region,
remote_offset, length)`` per op."""


def small_rows(ops: Any) -> Rows | None:
    """The batch as rows of integers if it is small enough for the fast path, else None."""
    if isinstance(ops, np.ndarray):
        if ops.dtype != OP_DTYPE or ops.ndim != 1 or len(ops) > SMALL_OPS:
            return None
        return ops.tolist()  # type: ignore[no-any-return]
    if isinstance(ops, list) and len(ops) <= SMALL_OPS:
        rows = _plain_rows(ops)
        return rows if rows is not None else normalize(ops).tolist()
    return None


_U32 = 1 << 32
_U64 = 1 << 64


def _plain_rows(ops: list[Any]) -> Rows | None:
    """A list of 5-tuples of plain integers in ``OP_DTYPE``'s ranges as it is (what
    ``normalize`` would make of it, at a tenth of its cost), else None (``normalize``
    converts the rest, or says what is wrong)."""
    rows = []
    for op in ops:
        if type(op) is not tuple or len(op) != 5:
            return None
        local, local_offset, remote, remote_offset, length = op
        if isinstance(local, (Region, RegionInfo)):
            local = local.id
        if isinstance(remote, (Region, RegionInfo)):
            remote = remote.id
        if not (
            type(local) is int
            and type(remote) is int
            and type(local_offset) is int
            and type(remote_offset) is int
            and type(length) is int
            and 0 <= local < _U32
            and 0 <= remote < _U32
            and 0 <= local_offset < _U64
            and 0 <= remote_offset < _U64
            and 0 <= length < _U64
        ):
            return None
        rows.append((local, local_offset, remote, remote_offset, length))
    return rows


def plan_small(
    rows: Rows,
    local: RegionTable,
    remote: Mapping[int, RegionInfo],
    access: str,
    *,
    device_ok: bool,
    slice_bytes: int,
) -> tuple[list[Region], list[FramePlan]] | None:
    """Check the batch (``LocalProtocolError`` as ``_ops.check`` raises it) and plan its one
    frame; ``None`` when it does not fit one slice (the caller takes the general path)."""
    if not rows:
        return [], []
    if sum(row[4] for row in rows) > slice_bytes:
        return None
    regions = check_small(rows, local, remote, access, device_ok=device_ok)
    mine = {region.id: region for region in regions}
    descriptors = [
        (remote_id, 0, remote[remote_id].key, offset, length)
        for _, _, remote_id, offset, length in rows
    ]
    views = [mine[r].view[o : o + n] for r, o, _, _, n in rows]
    nbytes = sum(row[4] for row in rows)
    frame = FramePlan(np.array(descriptors, DESCRIPTOR), views.copy, _ORIGINS[len(rows)], nbytes)
    return regions, [frame]


def check_small(
    rows: Rows,
    local: RegionTable,
    remote: Mapping[int, RegionInfo],
    access: str,
    *,
    device_ok: bool,
) -> list[Region]:
    """``_ops.check`` for a small batch (the same checks and errors): its local regions."""
    for index, row in enumerate(rows):
        if row[4] == 0:
            raise LocalProtocolError(f"op {index}: length 0", op_index=index)
    regions: dict[int, Region] = {}
    for index, (local_id, offset, _, _, length) in enumerate(rows):
        region = regions.get(local_id)
        if region is None:
            region = regions[local_id] = local.get(local_id)
            if access == "r" and region.readonly:
                raise LocalProtocolError(f"read into read-only local region {local_id}")
            if region.device and not device_ok:
                raise LocalProtocolError(f"local region {local_id} is GPU memory: use ucx")
        _bounds(index, "local", local_id, offset + length, region.length)
    for index, (_, _, remote_id, offset, length) in enumerate(rows):
        info = remote.get(remote_id)
        if info is None:
            raise LocalProtocolError(
                f"op {index}: the peer has no region {remote_id}", op_index=index
            )
        if access not in info.access:
            raise LocalProtocolError(f"remote region {remote_id} does not allow '{access}'")
        _bounds(index, "remote", remote_id, offset + length, info.length)
    return sorted(regions.values(), key=lambda r: r.id)


def _bounds(index: int, side: str, region_id: int, end: int, size: int) -> None:
    if end > size:
        raise LocalProtocolError(
            f"op {index}: bytes outside {side} region {region_id} ({size} bytes)",
            op_index=index,
        )
