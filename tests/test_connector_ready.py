"""``ConnectorCore.wait_ready``: a readiness probe, never a wait a request makes. Ready once
the store is reached and the mirror of its keys is in step (against a real ``kvbridge
serve --events-port``); not ready, within the bound asked for, when no server answers."""

from __future__ import annotations

import time

from helpers import free_port
from serve import ServeProcess

from kvbridge.bindings import ConnectorConfig, ConnectorCore, Identity

IDENTITY = Identity(
    engine="test",
    model="m",
    dtype="float32",
    layout="cpu/1x64",
    block_tokens=16,
    block_bytes=4096,
    shard="tp0/1",
)


def test_ready_means_connected_and_the_mirror_in_step() -> None:
    server = ServeProcess("--host-capacity", "16MiB", "--events-port", "0")
    try:
        config = ConnectorConfig.from_extra({"server": server.address})
        with ConnectorCore(config, IDENTITY, mirror=True) as core:
            assert core.wait_ready(30)
            ks = core.keys(list(range(64)))
            assert core.mirrored(ks) == 0  # answered from the mirror: no call, no None
    finally:
        server.kill()


def test_no_server_is_not_ready_within_the_bound() -> None:
    config = ConnectorConfig.from_extra({"server": f"127.0.0.1:{free_port()}", "timeout": 2})
    with ConnectorCore(config, IDENTITY, mirror=True) as core:
        started = time.monotonic()
        assert not core.wait_ready(1.0)
        assert time.monotonic() - started < 10  # bounded by the ask and a connect timeout
        assert core.mirrored(core.keys(list(range(64)))) is None
