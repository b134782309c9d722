"""The cache server's settings and operations: authentication, where it may listen, flags
then TOML then environment, and its metrics endpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from helpers import keys, payloads
from serve import ServeProcess

from kvbridge.store import (
    BlockNotFound,
    CacheServer,
    ConfigError,
    ServerConfig,
    StoreClient,
    load_config,
)
from kvbridge.transfer import AuthenticationError

BB = 64 << 10


@pytest.mark.slow
def test_auth_accepted_and_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("correct horse battery staple\n")
    server = ServeProcess("--secret-file", str(secret), "--host-capacity", "8MiB")
    try:
        with StoreClient(
            server.address, block_bytes=BB, namespace="m", secret="correct horse battery staple"
        ) as client:
            client.put(keys(0, 1), payloads(keys(0, 1), BB))
        with pytest.raises(AuthenticationError):
            StoreClient(server.address, block_bytes=BB, namespace="m", secret="wrong")
        with pytest.raises(AuthenticationError):
            StoreClient(server.address, block_bytes=BB, namespace="m")
    finally:
        server.stop()


def test_no_secret_means_loopback_only(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="secret"):
        load_config({"host": "0.0.0.0"}, environ={})
    assert load_config({"host": "0.0.0.0", "insecure": True}, environ={}).insecure
    refused = subprocess.run(
        [sys.executable, "-m", "kvbridge", "serve", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert refused.returncode == 2 and "secret" in refused.stderr


def test_settings_precedence_flags_then_toml_then_environment(tmp_path: Path) -> None:
    toml = tmp_path / "server.toml"
    toml.write_text('[server]\nport = 7701\nhost_capacity = "1GiB"\nlease_ttl = 5\n')
    env = {
        "KVBRIDGE_PORT": "7702",
        "KVBRIDGE_HOST_CAPACITY": "3GiB",
        "KVBRIDGE_MAX_NAMESPACES": "9",
    }
    config = load_config({"port": 7700, "host_capacity": None}, toml, env)
    assert config.port == 7700  # flag
    assert config.host_capacity == 1 << 30 and config.lease_ttl == 5.0  # file
    assert config.max_namespaces == 9  # environment
    assert load_config({}, None, {}).port == 7600  # embedded default
    (tmp_path / "bad.toml").write_text("nonsense = 1\n")
    with pytest.raises(ConfigError, match="nonsense"):
        load_config({}, tmp_path / "bad.toml", {})
    with pytest.raises(ConfigError, match="environment: host_capacity"):
        load_config({}, None, {"KVBRIDGE_HOST_CAPACITY": "lots"})


def test_metrics_endpoint_exposes_the_store_figures() -> None:
    config = ServerConfig(port=0, host_capacity=8 << 20, metrics_port=0)
    with CacheServer(config) as server:
        with StoreClient(server.address, block_bytes=BB, namespace="m") as client:
            ks = keys(0, 3)
            client.put(ks, payloads(ks, BB))
            client.get(ks, np.zeros((3, BB), np.uint8))
            with pytest.raises(BlockNotFound):
                client.get(keys(9, 10), np.zeros((1, BB), np.uint8))
        assert server.metrics_port is not None
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    assert 'kvbridge_hits_total{namespace="m/65536"} 3.0' in text
    assert 'kvbridge_misses_total{namespace="m/65536"} 1.0' in text
    assert 'kvbridge_tier_blocks{namespace="m/65536",tier="host"} 3.0' in text
    assert 'kvbridge_request_errors_total{kind="BlockNotFound",op="pin"} 1.0' in text
    assert 'kvbridge_request_seconds_count{op="stage"}' in text


@pytest.mark.slow
def test_environment_variables_reach_the_server_process() -> None:
    env = {**os.environ, "KVBRIDGE_HOST_CAPACITY": "3MiB"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    try:
        assert "(3 MiB host" in proc.stdout.readline()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_serve_takes_max_leases_per_client_as_a_flag() -> None:
    from kvbridge.tools import _serve_cmds  # noqa: PLC0415
    from kvbridge.tools.cli import _parser  # noqa: PLC0415

    args = _parser().parse_args(["serve", "--max-leases-per-client", "3"])
    assert args.max_leases_per_client == 3 and args.run is _serve_cmds._serve
