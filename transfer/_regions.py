"""Registered memory regions and the checks every remote op passes before a byte moves."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._device import is_device
from ._errors import AccessDenied, LocalProtocolError, RegionBusy
from ._protocol import SMALL_OPS
from ._sessions import Caller

ACCESS_MODES = ("r", "w", "rw", "none")
"""What peers may do to a region; ``"none"``: nothing (a buffer only this engine's own
batches read or fill; it is not even listed in the engine's metadata)."""

_PERMITS = {"r": ("r",), "w": ("w",), "rw": ("r", "w"), "none": ()}


def _nothing() -> None:
    pass


@dataclass
class Admission:
    """A guard's answer: which ops it allows and, when it allows all, what to call once their
    bytes have moved (the guard may hold what the ops touch until then)."""

    allowed: np.ndarray
    release: Callable[[], None] = _nothing


Guard = Callable[[Caller, str, np.ndarray, np.ndarray], Admission]
"""``guard(caller, access, offsets, lengths) -> Admission`` for the remote ops on a region
that passed the key and bounds checks. ``caller`` is the authenticated session. A guard that
refuses any op must hold nothing. Called from the engine's serving threads, several at once:
it must be thread-safe."""


@dataclass
class Use:
    """What a resolved remote batch holds until :meth:`RegionTable.finish`."""

    regions: list[Region]
    holds: list[Callable[[], None]] = field(default_factory=list)


def distinct(values: np.ndarray) -> list[int]:
    """The distinct values of a small integer array, sorted.

    ``numpy.unique`` costs about 25 us even for one element (numpy 2.x hashes); a batch
    almost always names one region, which this answers with one vectorised comparison.
    """
    if len(values) == 0:
        return []
    first = values[0]
    if (values == first).all():
        return [int(first)]
    return sorted(set(values.tolist()))


@dataclass(frozen=True)
class RegionInfo:
    """What a peer knows of a region: enough to address it, nothing to reach it without."""

    id: int
    length: int
    access: str
    key: int

    def to_wire(self) -> list[Any]:
        return [self.id, self.length, self.access, self.key]

    @classmethod
    def from_wire(cls, item: Any) -> RegionInfo:
        region_id, length, access, key = item
        if access not in ACCESS_MODES or length < 0 or not 0 <= key < 2**64:
            raise ValueError(f"bad region description {item!r}")
        return cls(int(region_id), int(length), str(access), int(key))


class Region:
    """A registered buffer. ``key`` is random (64 bits); remote ops must carry it.

    The engine holds a view of the buffer until :meth:`TransferEngine.unregister`: keep
    the buffer alive and do not resize it while registered. Host memory is viewed as a
    byte memoryview; GPU memory (anything with ``__cuda_array_interface__``, with cupy
    installed) as a 1-D ``uint8`` cupy array, and ``device`` is true: such a region moves
    over the ``ucx`` transport only.
    """

    def __init__(
        self, region_id: int, buffer: Any, access: str, guard: Guard | None = None
    ) -> None:
        if access not in ACCESS_MODES:
            raise LocalProtocolError(f"access must be one of {ACCESS_MODES}, not {access!r}")
        self.device = is_device(buffer)
        self.view: Any = _device_view(buffer) if self.device else _host_view(buffer)
        self.id = region_id
        self.length: int = self.view.nbytes
        self.access = access
        self.key = secrets.randbits(64)
        self.readonly = not self.device and self.view.readonly
        self.guard = guard
        self._busy = 0

    @property
    def info(self) -> RegionInfo:
        return RegionInfo(self.id, self.length, self.access, self.key)

    @property
    def in_use(self) -> int:
        """Transfers using the region now (``unregister`` refuses while there are any)."""
        return self._busy

    def __repr__(self) -> str:
        return f"Region(id={self.id}, length={self.length}, access={self.access!r})"


def _host_view(buffer: Any) -> memoryview:
    try:
        view = memoryview(buffer)
    except TypeError:
        raise LocalProtocolError(
            f"{type(buffer).__name__} does not support the buffer protocol"
        ) from None
    if not view.c_contiguous:
        raise LocalProtocolError("a region must be C-contiguous memory")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _device_view(buffer: Any) -> Any:
    try:
        import cupy  # noqa: PLC0415 - optional dependency
    except ImportError:
        raise LocalProtocolError("registering GPU memory needs cupy: kvbridge[gpu]") from None
    array = cupy.asarray(buffer)  # no copy: wraps __cuda_array_interface__
    if not array.flags.c_contiguous:
        raise LocalProtocolError("a region must be C-contiguous memory")
    return array.reshape(-1).view(cupy.uint8)


class RegionTable:
    """The engine's regions, by id; thread-safe."""

    def __init__(self) -> None:
        self._regions: dict[int, Region] = {}
        self._next_id = 1
        self._lock = threading.Lock()

    def register(self, buffer: Any, access: str, guard: Guard | None = None) -> Region:
        with self._lock:
            region = Region(self._next_id, buffer, access, guard)
            self._next_id += 1
            self._regions[region.id] = region
            return region

    def unregister(self, region: Region) -> None:
        with self._lock:
            if self._regions.get(region.id) is not region:
                raise LocalProtocolError(f"{region!r} is not registered here")
            if region._busy:
                raise RegionBusy(f"{region!r} is used by {region._busy} transfer(s)")
            del self._regions[region.id]
            if not region.device:
                region.view.release()

    def get(self, region_id: int) -> Region:
        with self._lock:
            region = self._regions.get(region_id)
        if region is None:
            raise LocalProtocolError(f"no registered region {region_id}")
        return region

    def infos(self) -> list[RegionInfo]:
        """What peers may address (regions with access ``"none"`` are left out)."""
        with self._lock:
            return [r.info for r in self._regions.values() if r.access != "none"]

    def acquire(self, regions: list[Region]) -> None:
        """Mark regions as used by a transfer (``unregister`` refuses until ``release``)."""
        with self._lock:
            for region in regions:
                region._busy += 1

    def release(self, regions: list[Region]) -> None:
        with self._lock:
            for region in regions:
                region._busy -= 1

    def finish(self, use: Use) -> None:
        """A resolved batch's bytes have moved (or failed to): release what it held."""
        try:
            for release in use.holds:
                release()
        finally:
            self.release(use.regions)

    def resolve(
        self,
        ops: np.ndarray,
        access: str,
        caller: Caller,
        *,
        device_ok: bool = False,
        merge: bool = False,
    ) -> tuple[list[memoryview], Use]:
        """Check remote ops (DESCRIPTOR array) of ``caller`` against the regions and return
        the views they address, with the regions acquired and the guards' holds taken
        (give both back with :meth:`finish`). ``device_ok``: the stream can carry GPU
        memory. ``merge``: ops that continue one another in a region share one view (the
        pipe moves one byte stream, so how views cut it does not matter; a KV cache's pages
        of one block land in one slot). Raises :class:`AccessDenied` naming the first bad
        op; nothing is held then.

        The lock covers only the lookup and the busy count: an acquired region cannot be
        unregistered and its fields do not change, so the checks (and the region's guard,
        which may take its owner's locks) run outside it and the serving threads do not
        queue behind each other's checks."""
        regions: dict[int, Region] = {}
        rows = ops.tolist() if len(ops) <= SMALL_OPS else None  # plain integers: see _check
        ids = sorted({row[0] for row in rows}) if rows is not None else distinct(ops["region"])
        with self._lock:
            for region_id in ids:
                region = self._regions.get(region_id)
                if region is None:
                    index = int(np.argmax(ops["region"] == region_id))
                    raise AccessDenied(f"op {index}: no region {region_id}", op_index=index)
                regions[region_id] = region
            for region in regions.values():
                region._busy += 1
        use = Use(list(regions.values()))
        try:
            for region_id, region in regions.items():
                if rows is not None:
                    _check_rows(rows, region_id, region, access, device_ok)
                else:
                    _check(ops, region_id, region, access, device_ok)
            for region_id, region in regions.items():
                if region.guard is not None:
                    use.holds.append(_admit(ops, region_id, region, access, caller))
            spans: Iterable[tuple[int, int, int]] = (
                ((r, o, n) for r, _, _, o, n in rows) if rows is not None else _spans(ops, merge)
            )
            views = [regions[r].view[o : o + n] for r, o, n in spans]
        except BaseException:
            self.finish(use)
            raise
        return views, use


def _spans(ops: np.ndarray, merge: bool) -> Iterable[tuple[int, int, int]]:
    """``(region, offset, length)`` per op, or per run of ops that continue one another in
    one region when ``merge``."""
    region, offset, length = ops["region"], ops["offset"], ops["length"]
    starts = run_starts(length, (region, offset)) if merge else None
    if starts is not None:
        region, offset = region[starts], offset[starts]
        length = np.add.reduceat(length, starts)
    return zip(region.tolist(), offset.tolist(), length.tolist(), strict=True)


def run_starts(length: np.ndarray, *sides: tuple[np.ndarray, np.ndarray]) -> np.ndarray | None:
    """Where each run of ops begins, a run being ops that each continue the one before in
    the same region on every side (``(region, offset)`` arrays); ``None`` when no op
    continues another."""
    if len(length) < 2:
        return None
    joins = np.ones(len(length) - 1, dtype=bool)
    for region, offset in sides:
        joins &= (region[1:] == region[:-1]) & (offset[1:] == offset[:-1] + length[:-1])
    if not joins.any():
        return None
    return np.flatnonzero(np.concatenate(([True], ~joins)))


def outside(
    offsets: np.ndarray, lengths: np.ndarray, region_length: int | np.ndarray
) -> np.ndarray:
    """Per op, whether ``offset..offset+length`` leaves a region of ``region_length`` bytes
    (one for all, or one per op; each operand is bounded first, so the unsigned sum cannot
    wrap around for a region below 2**63 bytes, as every real one is; a length a peer
    advertises past that is checked again by the peer against its real region)."""
    too_far = (offsets > region_length) | (lengths > region_length)
    result: np.ndarray = too_far | (offsets + lengths > region_length)
    return result


def _check(ops: np.ndarray, region_id: int, region: Region, access: str, device_ok: bool) -> None:
    """Raise :class:`AccessDenied` at the first op on ``region`` it must not run."""
    mine = ops["region"] == region_id
    bad = mine & (ops["key"] != region.key)
    reason = "wrong access key"
    if not bad.any() and access not in _PERMITS[region.access]:
        bad, reason = mine, f"region {region_id} does not allow '{access}'"
    if not bad.any() and access == "w" and region.readonly:
        bad, reason = mine, f"region {region_id} is read-only memory"
    if not bad.any() and region.device and not device_ok:
        bad, reason = mine, f"region {region_id} is GPU memory: it moves over ucx only"
    if not bad.any():
        bad = mine & outside(ops["offset"], ops["length"], region.length)
        reason = f"bytes outside region {region_id} ({region.length} bytes)"
    if bad.any():
        index = int(np.argmax(bad))
        raise AccessDenied(f"op {index}: {reason}", op_index=index)


def _check_rows(
    rows: list[tuple[int, int, int, int, int]],
    region_id: int,
    region: Region,
    access: str,
    device_ok: bool,
) -> None:
    """:func:`_check` for a few ops, as plain integers (``(region, flags, key, offset,
    length)`` rows): the same checks in the same order, the same first bad op."""
    mine = [i for i, row in enumerate(rows) if row[0] == region_id]
    bad = [i for i in mine if rows[i][2] != region.key]
    reason = "wrong access key"
    if not bad and access not in _PERMITS[region.access]:
        bad, reason = mine, f"region {region_id} does not allow '{access}'"
    if not bad and access == "w" and region.readonly:
        bad, reason = mine, f"region {region_id} is read-only memory"
    if not bad and region.device and not device_ok:
        bad, reason = mine, f"region {region_id} is GPU memory: it moves over ucx only"
    if not bad:
        bad = [i for i in mine if rows[i][3] + rows[i][4] > region.length]
        reason = f"bytes outside region {region_id} ({region.length} bytes)"
    if bad:
        raise AccessDenied(f"op {bad[0]}: {reason}", op_index=bad[0])


def _admit(
    ops: np.ndarray, region_id: int, region: Region, access: str, caller: Caller
) -> Callable[[], None]:
    """Ask the region's guard about its ops; return its hold, or raise naming the first
    op it refused (it then holds nothing)."""
    assert region.guard is not None
    mine = ops["region"] == region_id
    admission = region.guard(caller, access, ops["offset"][mine], ops["length"][mine])
    allowed = np.ones(len(ops), dtype=bool)
    allowed[mine] = admission.allowed
    if not allowed.all():
        admission.release()  # a guard that refused should hold nothing: make sure
        index = int(np.argmax(~allowed))
        message = f"op {index}: region {region_id} refuses this {access} op"
        raise AccessDenied(message, op_index=index)
    return admission.release
