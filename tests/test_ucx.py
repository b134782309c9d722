"""What is particular to the UCX transport: the fast path chosen without user settings, and
GPU memory (real cupy arrays where a GPU is present; the refusal rules everywhere)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import pytest
from attack import registered

from kvbridge.store._buffers import cupy_module
from kvbridge.transfer import LocalProtocolError, TransferEngine, TransferError, ucx_available
from kvbridge.transfer._nixl_agent import nixl_available

needs_ucx = pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed (kvbridge[ucx])")
cupy = cupy_module()
needs_gpu = pytest.mark.skipif(cupy is None, reason="cupy with a CUDA GPU is not available")
MiB = 1 << 20

_TRANSFER = textwrap.dedent(
    """
    import numpy as np
    from kvbridge.transfer import TransferEngine
    with TransferEngine("a", transports="ucx") as a, TransferEngine("b", transports="ucx") as b:
        src, dst = np.arange(4 << 20, dtype=np.uint8), np.zeros(4 << 20, np.uint8)
        here, there = a.register(src), b.register(dst)
        a.connect(b.metadata()).write([(here, 0, there.id, 0, src.nbytes)]).wait(10)
        assert (dst == src).all()
    print("moved")
    """
)


@pytest.mark.slow
@needs_ucx
def test_one_host_uses_shared_memory_without_user_settings() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    env["UCX_PROTO_INFO"] = "y"  # UCX prints the protocol and transport it chose
    done = subprocess.run(
        [sys.executable, "-c", _TRANSFER],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "moved" in done.stdout
    log = done.stdout + done.stderr
    # Large messages go by rendezvous over an intra-node transport: shared memory, or on a
    # GPU host (seen on an H200) cuda_ipc for part of the range; never TCP.
    rendezvous = re.findall(r"\|\s*[\dK]+\.\.[\dKMinf]+ \| .*rendezvous.*\| ([\w/]+)\s*\|", log)
    assert rendezvous, log[-2000:]
    intra_node = ("posix/memory", "sysv/memory", "cuda_ipc/cuda")
    assert all(t in intra_node for t in rendezvous), rendezvous


class _FakeGpuArray:
    """Looks like GPU memory to a duck-typing check; nothing may ever dereference it."""

    __cuda_array_interface__: ClassVar[dict[str, Any]] = {
        "shape": (16,),
        "typestr": "|u1",
        "data": (0, False),
        "version": 3,
    }


def test_gpu_memory_needs_the_ucx_transport() -> None:
    with (
        TransferEngine("host-only", transports="tcp") as engine,
        pytest.raises(LocalProtocolError, match="ucx"),
    ):
        engine.register(_FakeGpuArray())


@needs_ucx
def test_gpu_memory_without_cupy_is_a_clear_error() -> None:
    try:
        import cupy as _  # noqa: F401, PLC0415
    except ImportError:
        pass
    else:
        pytest.skip("cupy is installed")
    with TransferEngine("no-cupy", transports="ucx") as engine:
        with pytest.raises(LocalProtocolError, match="cupy"):
            engine.register(_FakeGpuArray())
        assert registered(engine) == 0


@pytest.fixture
def tcp_pair() -> Iterator[tuple[TransferEngine, TransferEngine]]:
    with (
        TransferEngine("initiator", transports="tcp", timeout=5.0) as a,
        TransferEngine("target", transports="tcp", timeout=5.0) as b,
    ):
        yield a, b


def test_a_gpu_region_refuses_ops_over_tcp(tcp_pair: tuple[TransferEngine, TransferEngine]) -> None:
    """The rule, checked on host memory marked as GPU memory (no GPU needed to test it):
    a GPU region moves over UCX only, on both ends, and a refusal moves no byte."""
    a, b = tcp_pair
    src, dst = np.ones(MiB, np.uint8), np.zeros(MiB, np.uint8)
    here, there = a.register(src), b.register(dst)
    there.device = True
    peer = a.connect(b.metadata())
    with pytest.raises(TransferError, match="GPU memory") as refused:
        peer.write([(here, 0, there.id, 0, MiB)]).wait(5)
    assert refused.value.op_index == 0
    assert not dst.any()
    there.device, here.device = False, True
    with pytest.raises(LocalProtocolError, match="GPU memory"):
        peer.write([(here, 0, there.id, 0, MiB)])
    here.device = False
    peer.write([(here, 0, there.id, 0, MiB)]).wait(5)  # both host memory again: it moves
    assert dst.all()


@needs_gpu
@pytest.mark.parametrize(
    "transport",
    [
        pytest.param("ucx", marks=needs_ucx),
        pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="no NIXL")),
    ],
)
def test_gpu_regions_over_ucx(transport: str) -> None:
    """Host -> GPU writes, GPU -> GPU writes and GPU -> host reads, large ops (sent as they
    are) and small ones (packed through host memory), bytes checked; over nixl too (NIXL's
    UCX, GPU memory registered as VRAM, moved one-sided)."""
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
        offsets = np.cumsum([0, *sizes[:-1]]).tolist()
        ops = [(host_r, o, gb.id, o, n) for o, n in zip(offsets, sizes, strict=True)]
        peer.write(ops).wait(30)
        np.testing.assert_array_equal(cupy.asnumpy(gpu_b), host)
        gpu_b[:] = 0
        cupy.copyto(gpu_a, cupy.asarray(host))
        peer.write([(ga, o, gb.id, o, n) for o, n in zip(offsets, sizes, strict=True)]).wait(30)
        np.testing.assert_array_equal(cupy.asnumpy(gpu_b), host)
        peer.read([(back_r, o, gb.id, o, n) for o, n in zip(offsets, sizes, strict=True)]).wait(30)
        np.testing.assert_array_equal(back, host)
