"""The connector moving a KV cache in CUDA memory (GPU only; skips elsewhere): save and load
of a 1,000-token prefix in Llama-3-8B's shape (32 layers, 8 KV heads, head_dim 128, bf16,
16-token blocks: 63 blocks x 32 layers = 2,016 pages of 64 KiB, 132 MB) in the KV cache vLLM
0.32 gives FlashAttention on an H100 or H200 (``tests/vllm_views.py``: one allocation for
every layer, a layer's ``[B, H, N, C]`` view in LBNHC, a page's K and V side by side per
token and head), through a ``kvbridge serve`` on the same machine, staged (TCP) and direct
(UCX, where ucxx and cupy take CUDA memory). Baselines, each in the same run: one
contiguous torch copy of the same bytes across PCIe (D2H into pinned memory for a save,
H2D for a load), and the same bytes as one raw TCP bulk send to a sink. Goal: >= 0.8x of
the slower of the two, staged; direct >= staged."""

from __future__ import annotations

import importlib.util
import itertools
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from serve import ServeProcess
from vllm_views import KVCache, Spec, allocate

from kvbridge.bindings import ConnectorConfig, ConnectorCore, Identity, PagedKV
from kvbridge.bindings.core import tensor_pages


def _torch() -> Any:
    if importlib.util.find_spec("torch") is None:
        return None
    import torch  # noqa: PLC0415

    return torch if torch.cuda.is_available() else None


torch = _torch()
pytestmark = pytest.mark.skipif(torch is None, reason="torch with a CUDA GPU is not available")

LAYERS, HEADS, HEAD_DIM, TOKENS, BLOCKS = 32, 8, 128, 16, 63
SPEC = Spec.attention(128, HEADS, TOKENS, HEAD_DIM, 2)  # a cache of 128 blocks, bf16
PAGE = SPEC.page  # K and V of a block of a layer: 64 KiB
NBYTES = BLOCKS * LAYERS * PAGE
PATHS = {"staged": "tcp", "direct": "ucx"}


@pytest.fixture(scope="module", params=list(PATHS))
def deployment(request: pytest.FixtureRequest) -> Iterator[tuple[str, ServeProcess]]:
    path = str(request.param)
    if path == "direct" and not all(importlib.util.find_spec(m) for m in ("ucxx", "cupy")):
        pytest.skip("ucxx and cupy are needed to move CUDA memory directly")
    served = ServeProcess(
        "--host-capacity", "8GiB", "--handoff-ttl", "0", "--transports", PATHS[path]
    )
    yield path, served
    served.kill()


@pytest.fixture(scope="module")
def sink() -> Iterator[socket.socket]:
    """A connection to the raw TCP sink (``_echo_server.py``): ``P`` + payload -> one byte."""
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "_echo_server.py"), str(NBYTES)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    port = int(proc.stdout.readline())
    conn = socket.create_connection(("127.0.0.1", port))
    yield conn
    conn.close()
    proc.stdin.close()
    proc.wait(10)


def _cache() -> tuple[KVCache, PagedKV]:
    cache = allocate("LBNHC", SPEC, LAYERS, torch.bfloat16, device="cuda")
    cache.raw.copy_(torch.randint(-128, 128, cache.raw.shape, dtype=torch.int8, device="cuda"))
    torch.cuda.synchronize()
    pages = tuple(p for n, t in cache.layers.items() for p in tensor_pages(n, t, PAGE))
    return cache, PagedKV(pages, "llama-3-8b/LBNHC/bf16")


@pytest.mark.parametrize("direction", ["save", "load"])
def test_connector_gpu(
    compare: Callable[..., Any],
    deployment: tuple[str, ServeProcess],
    sink: socket.socket,
    direction: str,
) -> None:
    path, server = deployment
    _, kv = _cache()
    identity = Identity(
        "bench", "llama-3-8b", "bfloat16", "cuda/LBNHC", TOKENS, LAYERS * PAGE, "tp0/1", path
    )
    config = ConnectorConfig.from_extra({"server": server.address, "transports": PATHS[path]})
    ids = list(range(BLOCKS))
    pinned = torch.empty(NBYTES, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(NBYTES, dtype=torch.uint8, device="cuda")
    payload = memoryview(pinned.numpy())
    rounds = itertools.count()
    with ConnectorCore(config, identity) as core:
        core.attach(kv)
        keys = core.keys(list(range(TOKENS * BLOCKS)))
        assert core.save(keys, ids)

        def save() -> None:  # new keys each round: every block moves
            start = next(rounds) << 20
            assert core.save(core.keys(list(range(start, start + TOKENS * BLOCKS))), ids)

        def load() -> None:
            assert core.load(keys, ids)
            torch.cuda.synchronize()

        def pcie() -> None:
            if direction == "save":
                pinned.copy_(device, non_blocking=True)
            else:
                device.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()

        def link() -> None:
            sink.sendall(b"P")
            sink.sendall(payload)
            assert sink.recv(1) == b"k"

        subject = save if direction == "save" else load
        for baseline, name in (
            (pcie, "one contiguous torch copy across PCIe"),
            (link, "raw TCP bulk"),
        ):
            compare(
                f"connector {direction}, {path}, 1,000 tokens of Llama-3-8B (132 MB)",
                subject,
                baseline,
                baseline_name=name,
                nbytes=NBYTES,
                rounds=10,
            )
