"""Host tier get and put with the caller's buffer at any alignment, against numpy.copyto.

The store's slots are page-aligned (for registration and O_DIRECT); a caller's array may
start anywhere (``np.empty`` gives 16 bytes past a page). On some CPUs (AMD EPYC with glibc
2.36, 4K aliasing in the large-copy path) a copy between a page-aligned buffer and one 16 to
256 bytes past a page runs at 2.5x the aligned time. For each offset of the caller's buffer
modulo 4096: ``get`` / ``put`` of 256 blocks of 1 MiB against ``numpy.copyto`` between a
page-aligned buffer and a buffer at the same offset (the copy the store makes), and the
same copy between two page-aligned buffers (what the offset costs the CPU itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import _EXTRA_LINES, _median_seconds

from kvbridge.store import TieredStore, prefix_hashes

BATCH = 256
BB = 1 << 20
PAGE = 4096
_ALIGNED: dict[str, float] = {}


def _at(offset: int, nbytes: int) -> np.ndarray:
    """``nbytes`` of fresh memory starting ``offset`` bytes past a page boundary."""
    raw = np.empty(nbytes + 2 * PAGE, np.uint8)
    start = (-raw.ctypes.data) % PAGE + offset
    view = raw[start : start + nbytes]
    view[:] = 0  # fault the pages in before timing
    return view


@pytest.mark.parametrize("offset", [0, 16, 64, 2048, 4080])
@pytest.mark.parametrize("op", ["get", "put"])
def test_copy_at_offset(compare: Callable[..., Any], op: str, offset: int) -> None:
    keys = prefix_hashes(range(BATCH * 16), 16)
    data = np.random.default_rng(0).integers(0, 256, BATCH * BB, dtype=np.uint8)
    user = _at(offset, BATCH * BB)
    slab_like = _at(0, BATCH * BB)
    other_aligned = _at(0, BATCH * BB)
    user[:] = data
    with TieredStore(BB, host_capacity=BATCH * BB) as store:
        if op == "get":
            store.put(keys, data)
            subject: Callable[[], object] = lambda: store.get(keys, user)  # noqa: E731
            baseline = lambda: np.copyto(user, slab_like)  # noqa: E731
            aligned = lambda: np.copyto(other_aligned, slab_like)  # noqa: E731
            setup = None
        else:
            subject = lambda: store.put(keys, user)  # noqa: E731
            baseline = lambda: np.copyto(slab_like, user)  # noqa: E731
            aligned = lambda: np.copyto(slab_like, other_aligned)  # noqa: E731
            setup = lambda: store.remove(keys)  # noqa: E731
        result = compare(
            f"host {op} 1 MiB x {BATCH}, caller buffer at +{offset}",
            subject,
            baseline,
            baseline_name=f"numpy.copyto aligned <-> +{offset}",
            nbytes=BATCH * BB,
            setup=setup,
            rounds=10,
        )
        if op == "get":
            store.get(keys, user)
            np.testing.assert_array_equal(user, data)
        aligned_s = _median_seconds(aligned, 10, None)
    line = (
        f"{op} at +{offset}: kvbridge {BATCH * BB / result.subject_s / 1e9:.2f} GB/s, copy "
        f"aligned <-> +{offset} {BATCH * BB / result.baseline_s / 1e9:.2f}, aligned <-> aligned "
        f"{BATCH * BB / aligned_s / 1e9:.2f} (offset costs the CPU "
        f"{result.baseline_s / aligned_s:.2f}x the aligned copy's time)"
    )
    _EXTRA_LINES.append(line)
    print(line)
