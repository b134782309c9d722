"""`kvbridge linkcheck` and `kvbridge bench`: namespaces made and always removed, shaping
applied, results shaped right. Figures themselves are benchmarks (benches/README.md)."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time

import pytest

from kvbridge.tools import _netns
from kvbridge.tools._bench import RawLink
from kvbridge.tools._link import link_speed

reason = _netns.available()
needs_netns = pytest.mark.skipif(reason is not None, reason=f"cannot make namespaces: {reason}")


def _ours() -> list[str]:
    return [n for n in _netns.names() if n.startswith(f"{_netns.PREFIX}")]


@needs_netns
def test_namespaces_are_made_and_removed_even_on_error() -> None:
    before = set(_ours())
    with pytest.raises(RuntimeError, match="boom"), _netns.ShapedLink(1e9, index=7) as link:
        assert set(link.namespaces) <= set(_netns.names())
        qdisc = subprocess.run(
            link.command(0, ["tc", "qdisc", "show", "dev", link.devices[0]]),
            capture_output=True,
            text=True,
            check=True,
        )
        assert "tbf" in qdisc.stdout and "rate 1Gbit" in qdisc.stdout
        raise RuntimeError("boom")
    assert set(_ours()) == before


@needs_netns
def test_stale_namespaces_of_dead_processes_are_removed() -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    name = f"{_netns.PREFIX}{int(dead.stdout)}-0a"
    subprocess.run(["ip", "netns", "add", name], check=True)
    assert name in _netns.remove_stale()
    assert name not in _netns.names()


@pytest.mark.slow
@needs_netns
def test_linkcheck_on_a_shaped_link() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbridge",
            "linkcheck",
            "--rates",
            "1",
            "--seconds",
            "0.5",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    (result,) = json.loads(done.stdout)
    assert result["rate_gbps"] == 1.0
    # The shaper holds the link to its rate: no run can beat it by more than the bucket.
    assert 0 < result["goodput_gbps"] < 1.1 and 0 < result["raw_goodput_gbps"] < 1.1
    assert result["ideal_request_s"] == pytest.approx(result["request_bytes"] * 8 / 1e9)
    assert not [n for n in _ours() if n.startswith(f"{_netns.PREFIX}{os.getpid()}")]


@pytest.mark.slow
@needs_netns
def test_sigterm_mid_run_still_removes_the_namespaces() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvbridge", "linkcheck", "--rates", "1", "--seconds", "20"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    prefix = f"{_netns.PREFIX}{proc.pid}-"
    deadline = time.monotonic() + 60
    while not any(n.startswith(prefix) for n in _netns.names()):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    time.sleep(1.0)  # mid-measurement
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    assert not any(n.startswith(prefix) for n in _netns.names())


@pytest.mark.slow
def test_linkcheck_on_loopback_says_so() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvbridge", "linkcheck", "--loopback", "--seconds", "0.3"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert "loopback, unshaped" in done.stdout and "Gbit/s" in done.stdout


@pytest.mark.slow
def test_bench_command_reports_rows_with_baselines() -> None:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "kvbridge", "bench", "--transports", "tcp", "--streams", "1"),
            *("--block-sizes", "64KiB", "--batch", "1,4", "--seconds", "0.05", "--json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    rows = json.loads(done.stdout)
    assert [(r["block_bytes"], r["batch"]) for r in rows] == [(65536, 1), (65536, 4)]
    for row in rows:
        assert row["gbps"] > 0 and row["raw_gbps"] > 0
        assert row["ratio"] == pytest.approx(row["gbps"] / row["raw_gbps"])
        assert row["p99_ms"] >= row["p50_ms"] > 0


def test_link_speed_measures_two_processes_and_a_dropped_sink_is_an_error(
    capfd: pytest.CaptureFixture[str],
) -> None:
    assert link_speed(2, seconds=0.2) > 1e7
    sink = socket.create_server(("127.0.0.1", 0))
    link = RawLink(sink.getsockname()[1], 2, memoryview(bytearray(256 << 20)))
    accepted = [sink.accept()[0] for _ in range(2)]
    for conn in accepted:  # the sink goes away with unread data: the sender sees a reset
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
    with pytest.raises(OSError):
        link.send(1 << 20, 64, 1)
    link.close()
    sink.close()
    assert "Traceback" not in capfd.readouterr().err
