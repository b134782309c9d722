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
from gpu_moves import gpu_round_trip

from kvbridge.store._buffers import cupy_module
from kvbridge.transfer import LocalProtocolError, TransferEngine, TransferError, ucx_available

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


@needs_ucx
@needs_gpu
def test_gpu_regions_over_ucx() -> None:
    """Host -> GPU writes, GPU -> GPU writes and GPU -> host reads, large ops (sent as they
    are) and small ones (packed through host memory), bytes checked."""
    gpu_round_trip("ucx")


@needs_ucx
def test_the_nixl_transport_is_refused_beside_ucx() -> None:
    """The other way round (``transfer/_ucx_builds.py``): after a ucx engine, nixl is refused
    before NIXL makes an agent, whether or not NIXL is installed here."""
    with TransferEngine(transports="ucx"):
        pass
    with pytest.raises(LocalProtocolError, match=r"clash|needs NIXL"):
        TransferEngine(transports="nixl")
