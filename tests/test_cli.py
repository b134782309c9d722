"""The kvbridge command line."""

from __future__ import annotations

import json
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


def test_help_lists_the_commands() -> None:
    result = _kvbridge("--help")
    assert result.returncode == 0
    for command in ("demo", "hash", "check"):
        assert command in result.stdout


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: kvbridge" in capsys.readouterr().out


def test_demo_runs_and_verifies_every_block() -> None:
    result = _kvbridge("demo", "--conversations", "8", "--turns", "4")
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(None, 1) for line in result.stdout.splitlines() if line)
    assert lines["requests"] == "32"
    hit_rate = float(lines["cached"].split("hit rate ")[1].rstrip("%)")) / 100
    assert 0.3 < hit_rate < 1.0  # later turns reuse earlier ones


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
