"""Device tier (GPU) put/get against cupy's own copy of the same bytes.

Needs cupy and a CUDA GPU; skipped otherwise. Run on a GPU machine with
``pytest benches/bench_device_tier.py -s``. Cases: device -> device-tier slots (put from a
cupy buffer) and device-tier slots -> host memory (get into a numpy buffer, a D2H copy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvbridge.store import TieredStore, prefix_hashes
from kvbridge.store._buffers import cupy_module

cupy = cupy_module()
pytestmark = pytest.mark.skipif(cupy is None, reason="cupy with a CUDA GPU is not available")
BATCH = 256


@pytest.mark.parametrize("block_bytes", [64 << 10, 1 << 20], ids=["64KiB", "1MiB"])
@pytest.mark.parametrize("op", ["put-d2d", "get-d2h"])
def test_device_tier(compare: Callable[..., Any], block_bytes: int, op: str) -> None:
    assert cupy is not None
    keys = prefix_hashes(range(BATCH * 16), 16)
    src = cupy.asarray(
        np.random.default_rng(0).integers(0, 256, (BATCH, block_bytes), dtype=np.uint8)
    )
    device_dst = cupy.empty_like(src)
    host_dst = np.empty((BATCH, block_bytes), np.uint8)
    sync = cupy.cuda.runtime.deviceSynchronize
    with TieredStore(block_bytes, device_capacity=BATCH * block_bytes, host_capacity=0) as store:
        if op == "put-d2d":

            def subject() -> None:
                store.put(keys, src)
                sync()

            def baseline() -> None:
                cupy.copyto(device_dst, src)
                sync()

            compare(
                f"device put {block_bytes >> 10} KiB x {BATCH} (D2D)",
                subject,
                baseline,
                setup=lambda: store.remove(keys),
                baseline_name="cupy.copyto",
                nbytes=BATCH * block_bytes,
            )
        else:
            store.put(keys, src)
            compare(
                f"device get {block_bytes >> 10} KiB x {BATCH} (D2H)",
                lambda: store.get(keys, host_dst),
                lambda: src.get(out=host_dst),
                baseline_name="cupy get(out=)",
                nbytes=BATCH * block_bytes,
            )
            np.testing.assert_array_equal(host_dst, cupy.asnumpy(src))
