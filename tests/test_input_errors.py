"""Bad input fails at once with a typed error (a CLI error: one line on stderr, a non-zero
exit, no traceback), and never becomes a hang or a silently wrong key.

The command-line tests run ``python -m kvbridge`` in a subprocess with a timeout, so a
regression to a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import keys

from kvbridge.store import (
    ConfigError,
    InvalidTokens,
    ServerConfig,
    StoreError,
    TieredStore,
    load_config,
    parse_size,
    prefix_hashes,
)
from kvbridge.transfer import LocalProtocolError
from kvbridge.transfer._address import BadAddress, parse_address, tcp_endpoint

_ENV = {name: value for name, value in os.environ.items() if not name.startswith("KVBRIDGE_")}
"""No ``KVBRIDGE_*`` setting of the caller's reaches the commands under test."""


def _kvbridge(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """``python -m kvbridge ARGS`` (as ``tests/test_cli.py`` runs it, with a short
    timeout: a hang raises ``TimeoutExpired`` and fails the test)."""
    return _python("-m", "kvbridge", *args, timeout=timeout)


def _python(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, *args]
    return subprocess.run(
        command, check=False, capture_output=True, text=True, timeout=timeout, env=_ENV
    )


def _one_line_error(result: subprocess.CompletedProcess[str], status: int | None = None) -> str:
    """Assert that the command failed with exactly one line on stderr; return the line."""
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert result.returncode != 0, result.stdout
    if status is not None:
        assert result.returncode == status, result.stderr
    return lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port some other socket has bound (and listens on)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


# -- A: addresses and ports ------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1:7600", ("127.0.0.1", 7600)),
        ("[::1]:7600", ("::1", 7600)),
        ("tcp://localhost:1", ("localhost", 1)),
        ("cache-0.example.internal:65535", ("cache-0.example.internal", 65535)),
    ],
)
def test_parse_address_accepts_host_port(address: str, expected: tuple[str, int]) -> None:
    assert parse_address(address) == expected
    host, port = expected
    assert tcp_endpoint(address) == (
        f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
    )


_BAD_ADDRESSES = "127.0.0.1|127.0.0.1:|:7600|127.0.0.1:0|127.0.0.1:65536|127.0.0.1:+1|"
_BAD_ADDRESSES += "127.0.0.1:7600 |::1:7600|[::1]|[nope]:1|999.1.1.1:1|host name:1|ipc:///tmp/x|"
"""The last one is the empty string."""


@pytest.mark.parametrize("address", [*_BAD_ADDRESSES.split("|"), 7600, None, b"[::1]:1"])
def test_parse_address_refuses_anything_else(address: object) -> None:
    with pytest.raises(BadAddress, match="host:port") as caught:
        parse_address(address)
    assert isinstance(caught.value, LocalProtocolError)
    assert not isinstance(address, str) or repr(address) in str(caught.value)


_DIAL = """
import sys
from kvbridge.store import StoreClient
from kvbridge.transfer import LocalProtocolError, TransferEngine
for address in sys.argv[1:]:
    try:
        StoreClient(address, block_bytes=4096)
    except LocalProtocolError as exc:
        print(f"{type(exc).__name__}|{exc}")
    with TransferEngine("dialer") as engine:
        try:
            engine.dial(address)
        except LocalProtocolError as exc:
            print(f"{type(exc).__name__}|{exc}")
"""


def test_a_forgotten_port_fails_at_once_in_the_client_and_the_engine() -> None:
    bad = ["127.0.0.1", "localhost:", "::1:7600"]
    result = _python("-c", _DIAL, *bad)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2 * len(bad)
    for line, address in zip(lines, [a for a in bad for _ in range(2)], strict=True):
        kind, message = line.split("|", 1)
        assert kind == "BadAddress" and repr(address) in message


@pytest.mark.slow
def test_stats_without_a_port_fails_with_one_line() -> None:
    line = _one_line_error(_kvbridge("stats", "127.0.0.1"), 1)
    assert line.startswith("kvbridge stats: ") and "'127.0.0.1'" in line and "port" in line


@pytest.mark.slow
def test_stats_of_a_port_nobody_listens_on_ends_with_one_line() -> None:
    line = _one_line_error(_kvbridge("stats", "127.0.0.1:1", timeout=30), 1)
    assert "127.0.0.1:1" in line


@pytest.mark.slow
def test_stats_with_a_missing_secret_file_fails_with_one_line(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere")
    line = _one_line_error(_kvbridge("stats", "127.0.0.1:1", "--secret-file", missing), 2)
    assert missing in line


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_serve_on_a_port_in_use_fails_with_one_line(busy_port: int, flag: str) -> None:
    args = ["--port", "0", flag, str(busy_port)] if flag != "--port" else [flag, str(busy_port)]
    assert "in use" in _one_line_error(_kvbridge("serve", *args, timeout=20), 2)


# -- B: server settings ----------------------------------------------------------------


_BAD_SERVE_FLAGS = {
    "unknown transport": ["--transports", "nope"],
    "memory transport": ["--transports", "memory"],
    "lease ttl inf": ["--lease-ttl", "inf"],
    "lease ttl negative": ["--lease-ttl", "-1"],
    "fractional host capacity": ["--host-capacity", "1.5"],
    "negative host capacity": ["--host-capacity", "-1"],
    "port out of range": ["--port", "70000"],
    "port not a number": ["--port", "x"],
    "unknown policy": ["--policy", "nope"],
    "missing secret file": ["--secret-file", "{missing}"],
    "disk path is a file": ["--disk-path", "{file}", "--disk-capacity", "1GiB"],
    "non-UTF-8 config": ["--config", "{latin1}"],
    "malformed config": ["--config", "{malformed}"],
    "missing config": ["--config", "{missing}"],
}


@pytest.mark.slow
@pytest.mark.parametrize("flags", list(_BAD_SERVE_FLAGS.values()), ids=list(_BAD_SERVE_FLAGS))
def test_serve_refuses_bad_settings_with_one_line(tmp_path: Path, flags: list[str]) -> None:
    files = {
        "missing": tmp_path / "missing",
        "file": tmp_path / "file",
        "latin1": tmp_path / "latin1.toml",
        "malformed": tmp_path / "malformed.toml",
    }
    files["file"].write_bytes(b"not a directory")
    files["latin1"].write_bytes('host = "caf\xe9"\n'.encode("latin-1"))
    files["malformed"].write_text("port = \n")
    args = [f.format(**{k: str(v) for k, v in files.items()}) for f in flags]
    if "--port" not in args:
        args += ["--port", "0"]  # if a bad setting were accepted, it would not take 7600
    line = _one_line_error(_kvbridge("serve", *args, timeout=20), 2)
    assert line.startswith("kvbridge serve")


_BAD_VALUES: dict[str, list[Any]] = {
    "lease_ttl": [math.inf, math.nan, 0, -1.0, "60", True, 365 * 86400.0],
    "handoff_ttl": [-1.0, math.inf, math.nan],
    "host_capacity": [1.5, -1, 0, "4GiB", True, 1 << 62],  # 2**62: more than any machine
    "max_namespaces": [0, 1.5],
    "max_leases_per_client": [0, 1.5],
    "port": [-1, 65536, "7600", True],
    "metrics_port": [-1, 65536],
    "transports": [("nope",), ("memory",), (), ("tcp", "tcp"), ("auto", "tcp"), "tcp"],
    "policy": ["nope", None],
    "secret": [b"", "s3cret"],
    "insecure": [1, "yes"],
    "host": ["", "127.0.0.1 ", None],
}
_BAD_CONFIGS: list[dict[str, Any]] = [
    *({name: value} for name, values in _BAD_VALUES.items() for value in values),
    {"host_capacity": 3, "max_namespaces": 4},  # less than a byte per namespace
    {"port": 7601, "metrics_port": 7601},
    {"disk_path": "{dir}"},  # without a capacity
    {"disk_capacity": 1 << 20},  # without a path
    {"disk_path": "{dir}", "disk_capacity": -1},
    {"disk_path": "{dir}", "disk_capacity": 1.5},
    {"disk_path": "{file}", "disk_capacity": 1 << 20},
    {"disk_path": "{file}/tier", "disk_capacity": 1 << 20},
    {"disk_path": "", "disk_capacity": 1 << 20},
]


@pytest.mark.parametrize("settings", _BAD_CONFIGS, ids=repr)
def test_server_config_refuses_every_bad_setting(tmp_path: Path, settings: dict[str, Any]) -> None:
    (tmp_path / "file").write_bytes(b"")
    where = {"dir": str(tmp_path / "tier"), "file": str(tmp_path / "file")}
    filled: dict[str, Any] = {
        k: v.format(**where) if isinstance(v, str) else v for k, v in settings.items()
    }
    with pytest.raises(ConfigError):
        ServerConfig(**filled)


def test_server_config_accepts_a_creatable_disk_path_without_creating_it(
    tmp_path: Path,
) -> None:
    tier = tmp_path / "a" / "b"
    config = ServerConfig(disk_path=str(tier), disk_capacity=64 << 20, handoff_ttl=0)
    assert config.disk_path == str(tier) and not tier.exists()
    assert ServerConfig(transports=("auto",), host="::1", secret=b"s").transports == ("auto",)


@pytest.mark.parametrize("text", ["1.5", "0.3KiB", "1.0001KiB", "-1GiB", "9999999999TiB", "٣"])
def test_parse_size_refuses_what_is_not_whole_bytes(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_parse_size_takes_exact_fractions_of_units() -> None:
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("0.57kB") == 570  # int(0.57 * 1000) would be 569 with floats
    assert parse_size("1.0") == 1


_BAD_TOML = {
    "not UTF-8": 'host = "caf\xe9"\n'.encode("latin-1"),
    "malformed": b"port = \n",
    "settings outside [server]": b"port = 7601\n[server]\nhost = '127.0.0.1'\n",
    "host not a string": b"host = 5\n",
    "insecure not a bool": b"insecure = 1\n",
    "transports not strings": b"transports = [1]\n",
    "lease_ttl inf": b"lease_ttl = inf\n",
    "secret in the file": b"secret = 'x'\n",
}


@pytest.mark.parametrize("content", list(_BAD_TOML.values()), ids=list(_BAD_TOML))
def test_load_config_refuses_a_bad_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "server.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=str(path)):
        load_config({}, path, {})


def test_load_config_refuses_a_missing_secret_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="secret_file"):
        load_config({"secret_file": str(tmp_path / "nowhere")}, None, {})


def _damaged_tier(path: Path, damage: str) -> None:
    bb = 4096
    ks = keys(0, 3)
    with TieredStore(bb, host_capacity=0, disk_path=path, disk_capacity=8 * bb) as store:
        store.put(ks, np.zeros(3 * bb, np.uint8))
    data = path / "data.mdb"
    raw = bytearray(data.read_bytes())
    if damage == "garbage":
        raw[:] = np.random.default_rng(0).bytes(len(raw))
    else:  # one page of the B-tree overwritten
        raw[2 * 4096 : 3 * 4096] = np.random.default_rng(1).bytes(4096)
    data.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["garbage", "page"])
def test_check_repair_of_a_damaged_tier_prints_one_line(tmp_path: Path, damage: str) -> None:
    _damaged_tier(tmp_path, damage)
    result = _kvbridge("check", "--repair", str(tmp_path), "--block-bytes", "4096", timeout=60)
    assert _one_line_error(result).startswith("kvbridge check: ")


_BOOM = """
import sys
import kvbridge.tools._store_cmds as cmds
from kvbridge.tools.cli import main

def boom(*args, **kwargs):
    raise {error}

cmds.prefix_hashes = boom
sys.exit(main(["hash", "1", "2"]))
"""


def test_an_unexpected_error_in_a_subcommand_is_one_line_and_status_1() -> None:
    result = _python("-c", _BOOM.format(error='RuntimeError("boom\\nsecond line")'))
    line = _one_line_error(result, 1)
    assert line == "kvbridge: error: RuntimeError: boom second line"


def test_ctrl_c_in_a_subcommand_is_status_130_without_a_traceback() -> None:
    result = _python("-c", _BOOM.format(error="KeyboardInterrupt"))
    assert _one_line_error(result, 130) == "kvbridge: interrupted"


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [["hash", "1.5"], ["hash", "+1"], ["hash", "1_0"], ["hash", "\u0663"], ["stats", "--nope"]],
)
def test_usage_errors_are_one_line(args: list[str]) -> None:
    line = _one_line_error(_kvbridge(*args), 2)
    assert line.startswith("kvbridge") and ": error: " in line and "--help" in line


# -- C: prefix-hash inputs -------------------------------------------------------------


_FLOAT_TOKENS: list[object] = [
    iter([0.9, 1.9]),
    [1.0],
    iter([1.0]),
    np.array([1.0]),
    [np.float32(1)],
]
_BOOL_TOKENS: list[object] = [[1, True], iter([True]), np.array([True, False])]
_ODD_TOKENS: list[object] = [[Decimal(1)], iter(["1"]), "12", b"\x01\x02", {1, 2}, {1: 2}, [[1, 2]]]


@pytest.mark.parametrize(
    "tokens", _FLOAT_TOKENS + _BOOL_TOKENS + _ODD_TOKENS, ids=lambda t: type(t).__name__
)
def test_prefix_hashes_refuses_what_is_not_int_token_ids(tokens: object) -> None:
    with pytest.raises(InvalidTokens):
        prefix_hashes(tokens, 1)  # type: ignore[arg-type]


_WRONG_TYPES = [5, 0, 1.5, [1], ["a"]]


@pytest.mark.parametrize(
    ("name", "value"),
    [("namespace", v) for v in [*_WRONG_TYPES, None]] + [("extra", v) for v in _WRONG_TYPES],
)
def test_prefix_hashes_refuses_a_namespace_or_extra_of_another_type(
    name: str, value: object
) -> None:
    with pytest.raises(StoreError) as caught:
        prefix_hashes([1, 2], 1, **{name: value})  # type: ignore[arg-type]
    assert isinstance(caught.value, TypeError) and name in str(caught.value)


def test_prefix_hashes_refuses_a_str_extra() -> None:
    with pytest.raises(TypeError, match="extra"):
        prefix_hashes([1, 2], 1, extra="lora-7")  # type: ignore[arg-type]


def test_prefix_hashes_still_takes_every_int_form() -> None:
    class Index:
        def __index__(self) -> int:
            return 3

    expected = prefix_hashes([5, 3], 1, namespace=b"m", extra=b"x")
    # bytearray and memoryview work for namespace and extra too (as annotated and documented).
    for tokens in ([np.uint64(5), 3], [np.int16(5), Index()], (t for t in [5, 3])):
        assert prefix_hashes(tokens, 1, namespace="m", extra=bytearray(b"x")) == expected
    assert prefix_hashes([5, 3], 1, namespace=memoryview(b"m"), extra=b"x") == expected
    assert prefix_hashes([5, 3], 1, extra=None) == prefix_hashes([5, 3], 1, extra=b"")


@pytest.mark.slow
def test_hash_command_matches_the_library_and_refuses_floats() -> None:
    result = _kvbridge("hash", "--block-tokens", "1", "--namespace", "m", "0", "1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [k.hex() for k in prefix_hashes([0, 1], 1, namespace="m")]
    line = _one_line_error(_kvbridge("hash", "--block-tokens", "1", "0.9", "1.9"), 2)
    assert "0.9" in line
