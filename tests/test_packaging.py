"""Packaging: the wheel installs only `kvbridge.*`, and that installed copy imports."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_holds_only_the_kvbridge_package(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("kvbridge-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"kvbridge"}
    for module in (
        "store/_keys.py",
        "transfer/__init__.py",
        "bindings/__init__.py",
        "routing/_relay.py",
        "tools/cli.py",
        "py.typed",
    ):
        assert f"kvbridge/{module}" in names

    # The unpacked wheel, first on the path, imports on its own (not via the source tree).
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = (
        "import kvbridge.store, kvbridge.tools.cli, kvbridge.transfer, kvbridge.bindings,"
        " kvbridge.routing;"
        "print(kvbridge.store.__file__)"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip().startswith(str(site))
    # No bare top-level component module sneaks in.
    bare = ("store/", "transfer/", "tools/", "bindings/", "routing/")
    assert not any(n.startswith(bare) for n in names)


def test_a_plain_store_user_does_not_load_the_server() -> None:
    """``import kvbridge.store`` loads neither pyzmq, prometheus-client nor the transfer
    engine: the client and server load on first use (PEP 562), and still import by name."""
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    probe = (
        "import sys, kvbridge.store as s\n"
        "heavy = [m for m in ('zmq', 'prometheus_client', 'kvbridge.transfer._engine')"
        " if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert s.StoreClient.__name__ == 'StoreClient' and 'zmq' in sys.modules\n"
        "from kvbridge.transfer import TransferEngine, Caller\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
