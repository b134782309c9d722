"""Every setting a user can give through the environment starts a real ``kvbridge serve``
with it, and the server runs with that value (the server logs its settings at start; the
secret is checked by what it does, since it is never logged)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import pytest
from helpers import free_port, keys, payloads

from kvbridge.store import ServerConfig, StoreClient
from kvbridge.tools._serve_cmds import read_listening
from kvbridge.transfer import AuthenticationError

BB = 64 << 10
_SETTINGS_LOG = "kvbridge.server: serving on "


@dataclass
class _Started:
    """A ``kvbridge serve`` started with some ``KVBRIDGE_*`` variables."""

    address: str
    line: str
    """Its ``listening on`` line."""
    settings: str
    """The settings it logged at start (``name=value, ...``)."""
    proc: subprocess.Popen[str]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.communicate(timeout=30)


def _serve(env: dict[str, str], *args: str) -> _Started:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**_clean_environ(), "KVBRIDGE_PORT": "0", **env},
    )
    assert proc.stdout is not None and proc.stderr is not None
    try:
        address, line = read_listening(proc.stdout)
    except RuntimeError:
        proc.wait(30)
        raise AssertionError(proc.stderr.read()) from None
    for logged in proc.stderr:  # logged before the listening line was printed
        if _SETTINGS_LOG in logged:
            return _Started(address, line, logged.rstrip("\n").split(": ", 2)[-1], proc)
    raise AssertionError("the server logged no settings")


def _clean_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVBRIDGE_")}


Check = Callable[[_Started, str], None]


def _logged(text: str) -> Check:
    def check(started: _Started, settings: str) -> None:
        assert text in settings.split(", ") or text in settings, settings

    return check


def _case(tmp: Path) -> dict[str, tuple[dict[str, str], Check]]:
    """Per setting: the variables that set it, and how to see that the server took it."""
    port, data_port, metrics, events = free_port(), free_port(), free_port(), free_port()
    disk = tmp / "disk"
    secret_file = tmp / "secret"
    secret_file.write_text("from a file\n")

    def on_port(started: _Started, settings: str) -> None:
        assert started.address.endswith(f":{port}")

    def on_data_port(started: _Started, settings: str) -> None:
        assert f"data_port={data_port}" in settings
        socket.create_connection(("127.0.0.1", data_port), timeout=10).close()  # it listens
        with StoreClient(started.address, block_bytes=BB, namespace="m") as client:
            client.put(keys(0, 1), payloads(keys(0, 1), BB))
            assert client.match_prefix(keys(0, 1)) == 1

    def on_metrics(started: _Started, settings: str) -> None:
        assert f"metrics on :{metrics}" in started.line

    def on_events(started: _Started, settings: str) -> None:
        assert f"events on :{events}" in started.line
        with StoreClient(started.address, block_bytes=BB, namespace="m") as client:
            assert client.subscription().endpoint.endswith(f":{events}")

    tenants = tmp / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "alpha"\nsecret = "alpha secret"\n')

    def on_tenants(started: _Started, settings: str) -> None:
        assert "tenants=alpha" in settings and "alpha secret" not in settings
        with StoreClient(
            started.address,
            block_bytes=BB,
            namespace="alpha/m",
            secret="alpha secret",
            tenant="alpha",
        ) as client:
            assert client.match_prefix(keys(0, 1)) == 0

    def on_disk(started: _Started, settings: str) -> None:
        assert f"disk {disk}" in started.line and f"disk_capacity={32 << 20}" in settings

    return {
        "host": ({"KVBRIDGE_HOST": "localhost"}, _logged("host=localhost")),
        "port": ({"KVBRIDGE_PORT": str(port)}, on_port),
        "data_port": ({"KVBRIDGE_DATA_PORT": str(data_port)}, on_data_port),
        "host_capacity": ({"KVBRIDGE_HOST_CAPACITY": "3MiB"}, _logged(f"host_capacity={3 << 20}")),
        "disk_path": (
            {"KVBRIDGE_DISK_PATH": str(disk), "KVBRIDGE_DISK_CAPACITY": "32MiB"},
            on_disk,
        ),
        "metrics_port": ({"KVBRIDGE_METRICS_PORT": str(metrics)}, on_metrics),
        "events_port": ({"KVBRIDGE_EVENTS_PORT": str(events)}, on_events),
        "events_hwm": ({"KVBRIDGE_EVENTS_HWM": "7"}, _logged("events_hwm=7")),
        "events_queue_bytes": (
            {"KVBRIDGE_EVENTS_QUEUE_BYTES": "1MiB"},
            _logged(f"events_queue_bytes={1 << 20}"),
        ),
        "events_memory": (
            {"KVBRIDGE_EVENTS_MEMORY": "64MiB"},
            _logged(f"events_memory={64 << 20}"),
        ),
        "max_namespaces": ({"KVBRIDGE_MAX_NAMESPACES": "3"}, _logged("max_namespaces=3")),
        "lease_ttl": ({"KVBRIDGE_LEASE_TTL": "7.5"}, _logged("lease_ttl=7.5")),
        "max_leases_per_client": (
            {"KVBRIDGE_MAX_LEASES_PER_CLIENT": "9"},
            _logged("max_leases_per_client=9"),
        ),
        "handoff_ttl": ({"KVBRIDGE_HANDOFF_TTL": "0"}, _logged("handoff_ttl=0.0")),
        "write_only_alarm": (
            {"KVBRIDGE_WRITE_ONLY_ALARM": "90"},
            _logged("write_only_alarm=90.0"),
        ),
        "policy": ({"KVBRIDGE_POLICY": "lru"}, _logged("policy=lru")),
        "keepalive": ({"KVBRIDGE_KEEPALIVE": "0.5"}, _logged("keepalive=0.5")),
        "transports": ({"KVBRIDGE_TRANSPORTS": "tcp"}, _logged("transports=('tcp',)")),
        "insecure": ({"KVBRIDGE_INSECURE": "true"}, _logged("insecure=True")),
        "secret_file": ({"KVBRIDGE_SECRET_FILE": str(secret_file)}, _logged("secret=set")),
        "tenants_file": ({"KVBRIDGE_TENANTS_FILE": str(tenants)}, on_tenants),
    }


_ENVIRONMENT_ONLY = {"secret"}  # tested on its own below: a secret is never logged
_FROM_A_FILE = {"secret_file": "secret", "tenants_file": "tenants"}
_COVERED_ELSEWHERE = {"disk_capacity"}  # goes with disk_path


def test_every_setting_has_an_environment_case(tmp_path: Path) -> None:
    names = {f.name for f in fields(ServerConfig)}
    assert set(_case(tmp_path)) == set(_SETTINGS)
    read_from = {_FROM_A_FILE.get(name, name) for name in _SETTINGS}
    assert names - _ENVIRONMENT_ONLY - _COVERED_ELSEWHERE == read_from - {"secret"}


_SETTINGS = (
    *("host", "port", "data_port", "host_capacity", "disk_path", "metrics_port", "max_namespaces"),
    *("events_port", "events_hwm", "events_queue_bytes", "events_memory"),
    *("lease_ttl", "max_leases_per_client", "handoff_ttl", "policy", "transports", "keepalive"),
    *("insecure", "secret_file", "tenants_file", "write_only_alarm"),
)


@pytest.mark.slow
@pytest.mark.parametrize("setting", _SETTINGS)
def test_a_setting_from_the_environment_reaches_the_server(tmp_path: Path, setting: str) -> None:
    env, check = _case(tmp_path)[setting]
    started = _serve(env)
    try:
        check(started, started.settings)
    finally:
        started.stop()


_FLAGS = {"tenants_file": "--tenants"}
"""Flags not named after their setting."""


def _as_flags(env: dict[str, str]) -> list[str]:
    flags: list[str] = []
    for variable, value in env.items():
        name = variable.removeprefix("KVBRIDGE_").lower()
        flags += [_FLAGS.get(name, "--" + name.replace("_", "-")), value]
    return flags


@pytest.mark.slow
@pytest.mark.parametrize("setting", _SETTINGS)
def test_a_setting_from_a_flag_reaches_the_server(tmp_path: Path, setting: str) -> None:
    env, check = _case(tmp_path)[setting]
    flags = _as_flags(env)
    if "--insecure" in flags:
        flags = ["--insecure"]  # a switch, without a value
    started = _serve({}, *flags)
    try:
        check(started, started.settings)
    finally:
        started.stop()


@pytest.mark.slow
def test_kvbridge_secret_is_the_servers_secret() -> None:
    started = _serve({"KVBRIDGE_SECRET": "sesame, from the environment"})
    try:
        with StoreClient(
            started.address, block_bytes=BB, namespace="m", secret="sesame, from the environment"
        ) as client:
            client.put(keys(0, 1), payloads(keys(0, 1), BB))
            assert client.match_prefix(keys(0, 1)) == 1
        for wrong in ("sesame", None):
            with pytest.raises(AuthenticationError):
                StoreClient(started.address, block_bytes=BB, namespace="m", secret=wrong)
        assert "secret=set" in started.settings
    finally:
        started.stop()


@pytest.mark.slow
def test_a_secret_file_flag_wins_over_kvbridge_secret(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text("from the flag\n")
    env = {"KVBRIDGE_SECRET": "from the environment"}
    started = _serve(env, "--secret-file", str(secret_file))
    try:
        with StoreClient(started.address, block_bytes=BB, namespace="m", secret="from the flag"):
            pass
        with pytest.raises(AuthenticationError):
            StoreClient(
                started.address, block_bytes=BB, namespace="m", secret="from the environment"
            )
    finally:
        started.stop()
