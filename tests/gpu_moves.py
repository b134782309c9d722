"""One GPU round trip over a transport that takes GPU memory (``ucx``, ``nixl``): host ->
GPU writes, GPU -> GPU writes and GPU -> host reads, large ops and small ones, bytes
checked. Needs cupy with a CUDA GPU (its callers skip without one)."""

from __future__ import annotations

import numpy as np

from kvbridge.store._buffers import cupy_module
from kvbridge.transfer import TransferEngine

MiB = 1 << 20


def gpu_round_trip(transport: str) -> None:
    cupy = cupy_module()
    assert cupy is not None
    sizes = [3 * MiB + 5, 4096, 100, 70_000, MiB]
    total = sum(sizes)
    host = np.random.default_rng(7).integers(0, 256, total, dtype=np.uint8)
    with (
        TransferEngine("prefill", transports=transport, timeout=10.0) as a,
        TransferEngine("decode", transports=transport, timeout=10.0) as b,
    ):
        gpu_a, gpu_b = cupy.zeros(total, cupy.uint8), cupy.zeros(total, cupy.uint8)
        back = np.zeros(total, np.uint8)
        host_r, back_r, ga = a.register(host), a.register(back), a.register(gpu_a)
        gb = b.register(gpu_b)
        assert ga.device and gb.device
        peer = a.connect(b.metadata())
        spans = list(zip(np.cumsum([0, *sizes[:-1]]).tolist(), sizes, strict=True))
        peer.write([(host_r, o, gb.id, o, n) for o, n in spans]).wait(30)
        np.testing.assert_array_equal(cupy.asnumpy(gpu_b), host)
        gpu_b[:] = 0
        cupy.copyto(gpu_a, cupy.asarray(host))
        peer.write([(ga, o, gb.id, o, n) for o, n in spans]).wait(30)
        np.testing.assert_array_equal(cupy.asnumpy(gpu_b), host)
        peer.read([(back_r, o, gb.id, o, n) for o, n in spans]).wait(30)
        np.testing.assert_array_equal(back, host)
