"""The device tier on a real GPU (skipped without cupy and a GPU).

Its logic runs on every machine in test_eviction.py (the same SlotTier over host memory);
this file checks the real cupy path: device buffers in and out, and demotion device ->
host -> disk with the bytes intact.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import keys, payloads

from kvbridge.store import TieredStore, TierUnavailable
from kvbridge.store._buffers import cupy_module

cupy = cupy_module()
needs_gpu = pytest.mark.skipif(cupy is None, reason="cupy with a CUDA GPU is not available")
BB = 64 << 10


def test_device_tier_without_gpu_is_a_clear_error() -> None:
    if cupy is not None:
        pytest.skip("this machine has a GPU")
    with pytest.raises(TierUnavailable, match="cupy"):
        TieredStore(BB, host_capacity=BB, device_capacity=BB)


@needs_gpu
def test_device_tier_round_trip_and_cascade(tmp_path: Path) -> None:
    assert cupy is not None
    with TieredStore(
        BB,
        device_capacity=4 * BB,
        host_capacity=4 * BB,
        disk_path=tmp_path,
        disk_capacity=16 * BB,
    ) as store:
        assert [t.name for t in store.tiers] == ["device", "host", "disk"]
        ks = keys(0, 12)
        host_data = payloads(ks, BB)
        for i in range(0, 12, 4):  # device buffers in
            store.put(ks[i : i + 4], cupy.asarray(host_data[i : i + 4]))
        assert [len(t) for t in store.tiers] == [4, 4, 4]
        out = cupy.zeros((12, BB), dtype=cupy.uint8)  # device buffers out
        store.get(ks, out)
        np.testing.assert_array_equal(cupy.asnumpy(out), host_data)
        host_out = np.zeros((12, BB), np.uint8)  # and host buffers out of the device tier
        store.get(ks, host_out)
        np.testing.assert_array_equal(host_out, host_data)
        # A get never evicts its own blocks, so those 12 promoted nothing; the oldest four
        # (on disk) alone move up to the device tier, and their bytes come back intact.
        assert store.stats().promotions == 0
        first = cupy.zeros((4, BB), dtype=cupy.uint8)
        store.get(ks[:4], first)
        assert store.stats().promotions == 4
        assert all(k in store.tiers[0] for k in ks[:4])
        np.testing.assert_array_equal(cupy.asnumpy(first), host_data[:4])
        store.get(ks[:4], host_out[:4])
        np.testing.assert_array_equal(host_out[:4], host_data[:4])
