"""Digests of a batch's groups of ops: the XXH3-64 of each group's local bytes, in op order.

A caller that checks what a read landed (a cache's reader against its writer's checksum)
names its groups (a KV block is one group: its pages, one op each), and the engine hashes
each group as the read lands it: over a byte stream (``tcp``), the stream's receiver thread
feeds a group's views to its digest as each one fills, while the frame's later bytes are
still arriving, so that the check ends with the transfer instead of after it. A group whose
bytes span frames, a pipe that lands a frame whole (``ucx``, ``memory``) and a one-sided
transfer (``nixl``) get the same digest, taken once the frame or the batch is done.

A write's groups are hashed by each stream's sender, about 1 MiB ahead of the send
(``Pipe.send``'s ``ready``), while the bytes before them are on their way; a ``notify``
made by a function takes them once every byte is written.

The digest of a group is that of its bytes one after another (``xxh3_64`` fed op by op), so
it does not depend on how the bytes were cut into ops: a block written as one buffer and
read as 32 pages has one digest.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from ._errors import LocalProtocolError
from ._ops import FramePlan

ViewOf = Callable[[int], memoryview | None]
"""A local region's bytes by region id, or ``None`` when they are not in host memory."""


def digest(pieces: Sequence[memoryview]) -> int:
    """The XXH3-64 of ``pieces`` one after another."""
    if len(pieces) == 1:
        return int(xxhash.xxh3_64_intdigest(pieces[0]))
    state = xxhash.xxh3_64()
    for piece in pieces:
        state.update(piece)
    return int(state.intdigest())


class Digests:
    """The digest of each group of a batch's ops, once the batch is done.

    ``starts``: the index of each group's first op, increasing from 0; group ``g`` is the
    ops from ``starts[g]`` to the next group's first (or the batch's end). Pass it to one
    ``read`` or ``write`` (``digests=``), wait for the batch, then take :meth:`values`.
    """

    def __init__(self, starts: Sequence[int] | np.ndarray) -> None:
        self._starts = np.asarray(starts, dtype=np.int64)
        self._values: list[int | None] = [None] * len(self._starts)
        self._done = np.zeros(len(self._starts), dtype=bool)
        self._pieces: Callable[[int], list[memoryview] | None] | None = None
        self._bytes = (np.zeros(0, np.int64), np.zeros(0, np.int64))  # each group's, in the batch
        self._host = np.zeros(0, dtype=bool)  # each group's bytes all in host memory
        self._lock = threading.Lock()

    def bind(self, ops: np.ndarray, view_of: ViewOf) -> None:
        """Attach the batch (its ops as given, ``OP_DTYPE``) and where its local bytes are;
        an engine calls this once, before any byte moves."""
        starts = self._starts
        if self._pieces is not None:
            raise LocalProtocolError("a Digests serves one batch")
        if len(starts) and (
            starts[0] != 0 or (np.diff(starts) <= 0).any() or starts[-1] >= len(ops)
        ):
            raise LocalProtocolError(f"digest groups must start at 0 and rise below {len(ops)}")
        ends = np.append(starts[1:], len(ops)).tolist()
        rows = list(
            zip(
                ops["local_region"].tolist(),
                ops["local_offset"].tolist(),
                ops["length"].tolist(),
                strict=True,
            )
        )
        regions = ops["local_region"]
        found = {r: view_of(r) for r in np.unique(regions).tolist()}

        def pieces(group: int) -> list[memoryview] | None:
            cut = []
            for region, at, n in rows[int(starts[group]) : ends[group]]:
                view = found[region]
                if view is None:
                    return None
                cut.append(view[at : at + n])
            return cut

        self._pieces = pieces
        if len(starts):
            host = [r for r, view in found.items() if view is not None]
            self._host = np.logical_and.reduceat(np.isin(regions, host), starts)
            lengths = ops["length"].astype(np.int64)
            op_ends = np.cumsum(lengths)
            last_ops = np.array(ends, dtype=np.int64) - 1
            self._bytes = (op_ends[starts] - lengths[starts], op_ends[last_ops])

    def follow(
        self, frames: Sequence[FramePlan], access: str
    ) -> list[Callable[[int], None] | None]:
        """Per frame, what hashes its groups as its views move (``landed(n)``: the first
        ``n`` views have landed, or are about to be sent), or ``None`` for a frame no group
        is hashed with. A read's group hashed with none (its bytes span frames) is hashed by
        :meth:`values`; a write's, by the frame that holds its last byte."""
        if not frames or not len(self._starts):
            return [None] * len(frames)
        # Planning merges and slices ops but keeps their bytes in order: a group's bytes are
        # the planned ops' from the one holding its first byte to the one holding its last.
        sizes = [len(frame.descriptors) for frame in frames]
        planned = np.concatenate([f.descriptors["length"] for f in frames]).astype(np.int64)
        planned_ends = np.cumsum(planned)
        frame_of = np.repeat(np.arange(len(frames)), sizes)
        first_view = np.cumsum([0, *sizes[:-1]])
        begin, end = self._bytes
        at_most = len(planned) - 1  # an empty group at the end holds no byte of any
        first = np.minimum(np.searchsorted(planned_ends, begin, side="right"), at_most)
        last = np.minimum(np.searchsorted(planned_ends, end - 1, side="right"), at_most)
        same = frame_of[first] == frame_of[last]
        hot = (same | (access == "w")) & (end > begin)  # a write's bytes are all there
        # A group whose bytes start and end at view boundaries is hashed view by view as
        # they move (in cache); any other, whole, once its last view has moved (one with
        # bytes in GPU memory gets no digest: ``take`` sees it).
        aligned = (planned_ends[first] - planned[first] == begin) & (planned_ends[last] == end)
        whole = same & aligned & self._host
        follow: list[Callable[[int], None] | None] = [None] * len(frames)
        for f in np.unique(frame_of[last[hot]]).tolist():
            mine = np.flatnonzero(hot & (frame_of[last] == f))
            begins = (first[mine] - first_view[f]).tolist()
            ends = (last[mine] - first_view[f] + 1).tolist()
            groups = list(zip(mine.tolist(), begins, ends, whole[mine].tolist(), strict=True))
            follow[f] = _Landing(self, frames[f], groups).landed
        return follow

    def put(self, group: int, value: int | None) -> None:
        """Record ``group``'s digest (``None``: its bytes are not in host memory)."""
        with self._lock:
            self._values[group], self._done[group] = value, True

    def take(self, group: int) -> None:
        """Hash ``group`` now (its bytes are all in place)."""
        assert self._pieces is not None
        pieces = self._pieces(group)
        self.put(group, None if pieces is None else digest(pieces))

    def values(self) -> list[int | None]:
        """Each group's digest, ``None`` for a group with bytes outside host memory. Call
        it once the batch is done: what was not hashed on its way is hashed now."""
        if self._pieces is None:
            raise LocalProtocolError("the Digests was given to no read or write")
        for group in np.flatnonzero(~self._done).tolist():
            self.take(group)
        return list(self._values)


class _Landing:
    """One frame's groups, hashed in the order their views land."""

    def __init__(
        self, digests: Digests, frame: FramePlan, groups: list[tuple[int, int, int, bool]]
    ) -> None:
        self._digests = digests
        self._frame = frame
        self._groups = groups  # (group, first view, end view, hashed view by view)
        self._next = 0  # the first group not done
        self._fed = 0  # how many of its views are hashed
        self._state = xxhash.xxh3_64()

    def landed(self, count: int) -> None:
        """The frame's first ``count`` views have landed: hash what they complete."""
        views = self._frame.views
        while self._next < len(self._groups):
            group, begin, end, streamed = self._groups[self._next]
            if not streamed:
                if end > count:
                    return
                self._digests.take(group)
            else:
                state = self._state
                for view in views[max(begin, self._fed) : min(end, count)]:
                    state.update(view)
                self._fed = max(self._fed, min(end, count))
                if self._fed < end:
                    return
                self._digests.put(group, int(state.intdigest()))
                state.reset()
            self._next += 1
