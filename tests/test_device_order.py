"""The order of the connector's moves against the engine's device work, on the device
layer's stand-in (``recording_device.py``) through a real server: a save's gather waits on
the mark the engine's thread made, on the saver thread, after that thread bound the device;
a load waits for its mark before it scatters; the direct path waits too; a copy that lost
the device's context turns the connector off (said once), one that did not is one miss."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
from recording_device import RecordingDevice
from serve import ServeProcess

from kvbridge.bindings import ConnectorConfig, ConnectorCore, Identity, PagedKV, SaveJob
from kvbridge.bindings.core import pages_of

PAGE, LAYERS, BLOCKS, TOKENS = 4096, 2, 8, 16
ENGINE = threading.current_thread().name


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    proc = ServeProcess("--host-capacity", "16MiB")
    yield proc
    proc.kill()


def _kv(seed: int) -> PagedKV:
    rng = np.random.default_rng(seed)
    layers = [rng.integers(0, 256, (BLOCKS, PAGE), dtype=np.uint8) for _ in range(LAYERS)]
    return PagedKV(tuple(pages_of(layer, f"l{i}") for i, layer in enumerate(layers)), "t")


def _core(server: ServeProcess, device: RecordingDevice, staging: str, name: str) -> ConnectorCore:
    identity = Identity(
        engine="test",
        model="m",
        dtype="uint8",
        layout=f"order/{name}/{staging}",
        block_tokens=TOKENS,
        block_bytes=PAGE * LAYERS,
        shard="tp0/1",
    )
    config = ConnectorConfig.from_extra(
        {"server": server.address, "staging": staging, "staging_bytes": "64KiB"}
    )
    return ConnectorCore(config, identity, saves=True, device=device)


def _saver(device: RecordingDevice) -> str:
    (thread,) = {c.thread for c in device.calls if c.thread != ENGINE}
    return thread


def test_a_queued_save_gathers_only_after_the_engines_mark(server: ServeProcess) -> None:
    device = RecordingDevice()
    with _core(server, device, "always", "save") as core:
        core.attach(_kv(1))
        keys = core.keys(list(range(TOKENS * 3)))
        mark = core.mark()  # wait_for_save, on the engine's thread
        core.save_later([SaveJob("r", tuple(keys), (0, 1, 2), mark=mark)])
        assert core.flush(["r"]) and core.lookup(keys) == 3
    assert device.ops(ENGINE) == [("mark", 0)]
    assert device.ops(_saver(device)) == [("bind", None), ("wait", 0), ("gather", None)]


@pytest.mark.parametrize("staging", ["always", "auto"])
def test_a_load_waits_for_its_mark_before_a_byte_moves(server: ServeProcess, staging: str) -> None:
    device = RecordingDevice()
    with _core(server, device, staging, "load") as core:
        source = _kv(2)
        core.attach(source)
        keys = core.keys(list(range(TOKENS * 2)))
        core.save_later([SaveJob("r", tuple(keys), (4, 5), mark=core.mark())])
        assert core.flush(["r"])
        device.calls.clear()
        expected = source.gather([4, 5])
        loaded = threading.Thread(
            target=lambda: core.load(keys, [0, 1], after=0), name="kvbridge-loader"
        )
        loaded.start()
        loaded.join()
        assert np.array_equal(source.gather([0, 1]), expected)
    copy = [("scatter", None)] if staging == "always" else []  # direct: the transport writes
    assert device.ops("kvbridge-loader") == [("bind", None), ("wait", 0), *copy]


def test_a_copy_that_lost_the_device_turns_the_connector_off_once(
    server: ServeProcess, caplog: pytest.LogCaptureFixture
) -> None:
    device = RecordingDevice(fail=True, sticky=True)
    with _core(server, device, "always", "lost") as core:
        core.attach(_kv(3))
        keys = core.keys(list(range(TOKENS * 2)))
        for request in ("a", "b"):
            core.save_later([SaveJob(request, tuple(keys), (0, 1), mark=core.mark())])
            assert core.flush([request])
        assert not core.load(keys, [2, 3])
    lost = [r for r in caplog.records if "context is lost" in r.getMessage()]
    assert len(lost) == 1 and lost[0].levelname == "ERROR"
    assert "illegal memory access" in lost[0].getMessage()
    assert [op for op, _ in device.ops()].count("gather") == 1  # nothing moved after it


def test_a_copy_that_failed_alone_is_one_miss(
    server: ServeProcess, caplog: pytest.LogCaptureFixture
) -> None:
    device = RecordingDevice(fail=True, sticky=False)
    with _core(server, device, "always", "alone") as core:
        core.attach(_kv(4))
        keys = core.keys(list(range(TOKENS * 2)))
        core.save_later([SaveJob("a", tuple(keys), (0, 1), mark=core.mark())])
        assert core.flush(["a"]) and core.lookup(keys) == 0
        device.fail = False
        core.save_later([SaveJob("b", tuple(keys), (0, 1), mark=core.mark())])
        assert core.flush(["b"]) and core.lookup(keys) == 2
    assert "context is lost" not in caplog.text


def test_a_wait_that_meets_a_lost_context_turns_the_connector_off(
    server: ServeProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """A sticky error shows first where the mover waits for the engine's mark: that is
    the device's fault too, not an exception out of the saver."""
    device = RecordingDevice(fail_wait=True, sticky=True)
    with _core(server, device, "always", "wait") as core:
        core.attach(_kv(5))
        keys = core.keys(list(range(TOKENS * 2)))
        core.save_later([SaveJob("a", tuple(keys), (0, 1), mark=core.mark())])
        assert core.flush(["a"])
        assert not core.load(keys, [2, 3], after=core.mark())
    lost = [r for r in caplog.records if "context is lost" in r.getMessage()]
    assert len(lost) == 1 and "device-side assert" in lost[0].getMessage()
    assert "a save of" not in caplog.text  # handled as a fault, not raised
    assert [op for op, _ in device.ops()].count("wait") == 1
