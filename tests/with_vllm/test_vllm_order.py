"""The worker side orders its moves against vLLM's device work as vLLM drives it (its
calls, in a real server's company, on the device layer's stand-in
``tests/recording_device.py``): ``wait_for_save`` marks the engine's stream on the
engine's thread and the saver thread's gather waits on that mark; ``start_load_kv`` marks
it before a synchronous load's scatter and before an async load the loader thread runs;
every thread that moves pages binds the device first. The GPU run of the same
(``benches/gpu_check.sh``) delays the engine's writes with a kernel, where a missing wait
shows as wrong bytes."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from helpers import until
from recording_device import RecordingDevice
from serve import ServeProcess

from kvbridge.bindings import ConnectorConfig, ConnectorCore, Identity
from kvbridge.bindings.vllm._meta import StepMeta, Transfer
from kvbridge.bindings.vllm._worker import WorkerSide

BLOCKS, HEADS, TOKENS, HEAD = 8, 2, 16, 64
LAYERS = 2
PAGE = HEADS * TOKENS * 2 * HEAD * 2  # bf16 K and V
ENGINE = threading.current_thread().name


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    proc = ServeProcess("--host-capacity", "16MiB")
    yield proc
    proc.kill()


def _caches(seed: int) -> dict[str, torch.Tensor]:
    """vLLM 0.32's LBNHC views of one allocation (``[B, H, N, C]``, N outside H)."""
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (LAYERS * BLOCKS * PAGE,), dtype=torch.uint8, generator=generator)
    full = raw.view(torch.bfloat16).as_strided(
        (LAYERS, BLOCKS, HEADS, TOKENS, 2 * HEAD),
        (BLOCKS * PAGE // 2, PAGE // 2, 2 * HEAD, HEADS * 2 * HEAD, 1),
    )
    return {f"layers.{i}.attn": full[i] for i in range(LAYERS)}


def _worker(server: ServeProcess, device: RecordingDevice) -> tuple[WorkerSide, ConnectorCore]:
    identity = Identity(
        engine="test",
        model="m",
        dtype="torch.bfloat16",
        layout="order/LBNHC",
        block_tokens=TOKENS,
        block_bytes=PAGE * LAYERS,
        shard="tp0/1",
    )
    config = ConnectorConfig.from_extra(
        {"server": server.address, "staging": "always", "staging_bytes": "64KiB"}
    )
    core = ConnectorCore(config, identity, saves=True, device=device)
    return WorkerSide(core, loader=True, layout="LBNHC"), core


def _block(caches: dict[str, torch.Tensor], layer: int, block: int) -> bytes:
    view = list(caches.values())[layer][block]
    return bytes(view.contiguous().view(torch.uint8).numpy())


def test_saves_wait_for_the_step_and_loads_for_the_engine(server: ServeProcess) -> None:
    device, loads = RecordingDevice(), RecordingDevice()
    source, target = _caches(1), _caches(2)
    saver, save_core = _worker(server, device)
    loader, load_core = _worker(server, loads)
    try:
        saver.register(source)
        loader.register(target)
        keys = tuple(save_core.keys(list(range(TOKENS * 4))))
        saver.save(StepMeta(saves=[Transfer("r", keys, (3, 0, 7, 6))]))  # wait_for_save
        until(lambda: not save_core.saving("r"), "the save ran")
        step = StepMeta(
            loads=[Transfer("a", keys[:2], (1, 2))],
            async_loads=[Transfer("b", keys[2:], (4, 5), start=2)],
        )
        loader.load(step)  # start_load_kv
        until(lambda: loader.finished(set())[1] == {"b"}, "the async load ended")
    finally:
        for side, core in ((saver, save_core), (loader, load_core)):
            side.close()
            core.close()
    for layer in range(LAYERS):
        for src, dst in zip((3, 0, 7, 6), (1, 2, 4, 5), strict=True):
            assert _block(target, layer, dst) == _block(source, layer, src)
    assert device.ops(ENGINE) == [("mark", 0)]
    (thread,) = device.threads("gather")
    assert thread != ENGINE
    assert device.ops(thread) == [("bind", None), ("wait", 0), ("gather", None)]
    assert loads.ops(ENGINE) == [("mark", 0), ("bind", None), ("wait", 0), ("scatter", None)]
    (async_thread,) = loads.threads("scatter") - {ENGINE}
    assert loads.ops(async_thread) == [("bind", None), ("wait", 0), ("scatter", None)]


def test_an_async_load_that_raises_is_reported_failed_never_received(
    server: ServeProcess,
) -> None:
    loader, core = _worker(server, RecordingDevice())
    try:
        loader.register(_caches(3))
        keys = tuple(core.keys(list(range(TOKENS * 2))))
        loader.load(StepMeta(async_loads=[Transfer("b", keys, (BLOCKS, BLOCKS + 1))]))
        received: set[str] = set()

        def ended() -> bool:
            done = loader.finished(set())[1]
            received.update(done or ())
            return bool(received)

        until(ended, "the async load ended")
        assert loader.load_errors() == {BLOCKS, BLOCKS + 1}  # outside the cache: failed
    finally:
        loader.close()
        core.close()
