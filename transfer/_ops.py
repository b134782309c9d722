"""Batches of ops: normalising what the caller gave, checking it, and planning frames.

An op is ``(local_region, local_offset, remote_region, remote_offset, length)``. A batch is
checked whole before anything is sent (validate first, then act). Planning merges ops that
continue each other on both sides, cuts long ops into slices (so that several streams share
them) and packs the result into frames of at most ``frame_bytes`` and
``MAX_OPS_PER_FRAME`` ops. Everything is vectorised: thousands of ops cost microseconds each.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any

import numpy as np

from ._errors import LocalProtocolError
from ._protocol import DESCRIPTOR, MAX_OPS_PER_FRAME
from ._regions import Region, RegionInfo, RegionTable, distinct, outside, run_starts

OP_DTYPE = np.dtype(
    [
        ("local_region", "<u4"),
        ("local_offset", "<u8"),
        ("remote_region", "<u4"),
        ("remote_offset", "<u8"),
        ("length", "<u8"),
    ]
)
"""A batch as a numpy structured array (``numpy.zeros(n, OP_DTYPE)``): the cheap form."""


@dataclass
class FramePlan:
    """The ops of one frame: wire descriptors, local views, and each op's index in the batch.

    ``views`` are cut from ``cut`` when first asked for: a batch of thousands of pages has
    its first frame on the wire while the views of the next ones are cut."""

    descriptors: np.ndarray
    cut: Callable[[], list[memoryview]]
    origin: np.ndarray
    nbytes: int

    @cached_property
    def views(self) -> list[memoryview]:
        return self.cut()


def normalize(ops: Any) -> np.ndarray:
    """Return the batch as a fresh ``OP_DTYPE`` array (regions may be given as objects)."""
    if isinstance(ops, np.ndarray):
        if ops.dtype == OP_DTYPE and ops.ndim == 1:  # unsigned fields: nothing to check
            fresh: np.ndarray = ops.copy()
            return fresh
        if ops.dtype.names is None or set(OP_DTYPE.names or ()) - set(ops.dtype.names):
            raise LocalProtocolError(f"an op array needs the fields {OP_DTYPE.names}")
        if ops.ndim != 1:
            raise LocalProtocolError("an op array must be one-dimensional")
        for name in OP_DTYPE.names or ():
            if ops.dtype[name].kind not in "iu" or (ops[name] < 0).any():
                raise LocalProtocolError(f"op field {name} must hold non-negative integers")
        return ops.astype(OP_DTYPE)
    if not isinstance(ops, Sequence):
        raise LocalProtocolError("ops must be a numpy array of OP_DTYPE or a list of tuples")
    rows = []
    for index, op in enumerate(ops):
        try:
            local, local_offset, remote, remote_offset, length = op
        except (TypeError, ValueError):
            raise LocalProtocolError(f"op {index} is not a 5-tuple") from None
        rows.append((_region_id(local), local_offset, _region_id(remote), remote_offset, length))
    try:
        return np.array(rows, dtype=OP_DTYPE)
    except (OverflowError, TypeError, ValueError) as exc:
        raise LocalProtocolError(f"ops must hold non-negative integers: {exc}") from None


def _region_id(region: Any) -> Any:
    return region.id if isinstance(region, (Region, RegionInfo)) else region


def check(
    ops: np.ndarray,
    local: RegionTable,
    remote: Mapping[int, RegionInfo],
    access: str,
    *,
    device_ok: bool = False,
) -> list[Region]:
    """Check a batch against local regions and the peer's regions; return the local regions.

    ``access`` is what the batch needs of the remote regions: ``"w"`` (write) or ``"r"``.
    ``device_ok``: the transport carries GPU memory (local GPU regions are refused if not).
    """
    if len(ops) == 0:
        return []
    if ops["length"].min() == 0:
        bad = np.flatnonzero(ops["length"] == 0)
        raise LocalProtocolError(f"op {bad[0]}: length 0", op_index=int(bad[0]))
    regions = [local.get(region_id) for region_id in distinct(ops["local_region"])]
    for region in regions:
        if access == "r" and region.readonly:
            raise LocalProtocolError(f"read into read-only local region {region.id}")
        if region.device and not device_ok:
            raise LocalProtocolError(f"local region {region.id} is GPU memory: use ucx")
    _check_bounds(ops, "local", {r.id: r.length for r in regions})
    sizes = {}
    for region_id in distinct(ops["remote_region"]):
        info = remote.get(region_id)
        if info is None:
            index = int(np.argmax(ops["remote_region"] == region_id))
            raise LocalProtocolError(
                f"op {index}: the peer has no region {region_id}", op_index=index
            )
        if access not in info.access:
            raise LocalProtocolError(f"remote region {region_id} does not allow '{access}'")
        sizes[region_id] = info.length
    _check_bounds(ops, "remote", sizes)
    return regions


def _check_bounds(ops: np.ndarray, side: str, sizes: Mapping[int, int]) -> None:
    """Raise at the first op whose bytes leave its ``side`` region (``sizes``: by id)."""
    ids = ops[f"{side}_region"]
    limit: np.ndarray | int
    if len(sizes) == 1:
        limit = next(iter(sizes.values()))
        if _within(ops[f"{side}_offset"], ops["length"], limit):
            return
    else:  # one vectorised check for every region: a KV cache names one per layer
        known = np.array(sorted(sizes), dtype=np.uint64)
        lengths = np.array([sizes[int(r)] for r in known], dtype=np.uint64)
        limit = lengths[np.searchsorted(known, ids)]
    bad = outside(ops[f"{side}_offset"], ops["length"], limit)
    if bad.any():
        index = int(np.argmax(bad))
        region_id, size = int(ids[index]), sizes[int(ids[index])]
        raise LocalProtocolError(
            f"op {index}: bytes outside {side} region {region_id} ({size} bytes)",
            op_index=index,
        )


def _within(offsets: np.ndarray, lengths: np.ndarray, limit: int) -> bool:
    """Whether every op is inside one region of ``limit`` bytes (three reductions where
    ``outside`` takes six calls; the sum cannot wrap once both operands are bounded)."""
    return bool(
        offsets.max() <= limit and lengths.max() <= limit and (offsets + lengths).max() <= limit
    )


def plan(
    ops: np.ndarray,
    local: RegionTable,
    remote: Mapping[int, RegionInfo],
    *,
    slice_bytes: int,
    frame_bytes: int,
    streams: int = 1,
) -> list[FramePlan]:
    """Merge, slice and pack a checked batch into frames.

    Frames hold at most ``frame_bytes``, and no more than an even share of the batch per
    stream, so that a mid-sized batch still spreads over every stream.
    """
    if len(ops) == 0:
        return []
    ops, origin = _coalesce(ops)
    ops, origin = _slice(ops, origin, slice_bytes)
    share = -(-int(ops["length"].sum(dtype=np.uint64)) // streams)
    frame_bytes = max(slice_bytes, min(frame_bytes, share))
    keys = np.zeros(len(ops), dtype=np.uint64)
    for region_id in distinct(ops["remote_region"]):
        keys[ops["remote_region"] == region_id] = remote[region_id].key
    views = {r: local.get(r).view for r in distinct(ops["local_region"])}

    ends = np.cumsum(ops["length"], dtype=np.uint64)
    frames = []
    start = 0
    while start < len(ops):
        base = int(ends[start - 1]) if start else 0
        stop = int(np.searchsorted(ends, base + frame_bytes, side="right"))
        stop = min(max(stop, start + 1), start + MAX_OPS_PER_FRAME)
        part = ops[start:stop]
        descriptors = np.zeros(len(part), dtype=DESCRIPTOR)
        descriptors["region"] = part["remote_region"]
        descriptors["key"] = keys[start:stop]
        descriptors["offset"] = part["remote_offset"]
        descriptors["length"] = part["length"]
        cut = partial(_cut, views, part)
        frames.append(FramePlan(descriptors, cut, origin[start:stop], int(ends[stop - 1]) - base))
        start = stop
    return frames


def _cut(views: Mapping[int, memoryview], part: np.ndarray) -> list[memoryview]:
    """The local views of a frame's ops."""
    return [
        views[r][o : o + n]
        for r, o, n in zip(
            part["local_region"].tolist(),
            part["local_offset"].tolist(),
            part["length"].tolist(),
            strict=True,
        )
    ]


def _coalesce(ops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge each op into the previous one when it continues it on both sides."""
    starts = run_starts(
        ops["length"],
        (ops["local_region"], ops["local_offset"]),
        (ops["remote_region"], ops["remote_offset"]),
    )
    if starts is None:
        return ops, np.arange(len(ops))
    merged = ops[starts].copy()
    merged["length"] = np.add.reduceat(ops["length"], starts)
    return merged, starts


def _slice(ops: np.ndarray, origin: np.ndarray, slice_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Cut ops longer than ``slice_bytes`` into pieces, so that streams can share them."""
    pieces = (ops["length"] + np.uint64(slice_bytes - 1)) // np.uint64(slice_bytes)
    if (pieces == 1).all():
        return ops, origin
    pieces = pieces.astype(np.int64)
    index = np.repeat(np.arange(len(ops)), pieces)
    first = np.repeat(np.cumsum(pieces) - pieces, pieces)
    shift = ((np.arange(len(index)) - first) * slice_bytes).astype(np.uint64)
    out = ops[index].copy()
    out["local_offset"] += shift
    out["remote_offset"] += shift
    out["length"] = np.minimum(np.uint64(slice_bytes), ops["length"][index] - shift)
    return out, origin[index]
