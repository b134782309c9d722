"""A network namespace joined to the tests' own by a veth pair (needs root and iproute2),
for a third-party server that binds every interface (Dynamo's indexer has no host flag):
inside it, every interface is the pair's end. This end is ``10.232.N.1``, its ``.2``;
everything is named after this process's pid and deleted on close."""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import AbstractContextManager
from typing import Any


def unavailable() -> str | None:
    """Why a namespace cannot be made here (``None``: it can)."""
    if os.geteuid() != 0:
        return "making a network namespace needs root"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2)"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class PeerNamespace(AbstractContextManager["PeerNamespace"]):
    def __init__(self, index: int = 0) -> None:
        tag = f"{os.getpid() % 100000}{index}"
        self.name = f"kvb-peer-{tag}"
        self.here, self.there = f"kvbh{tag}", f"kvbp{tag}"
        subnet = f"10.232.{index % 250}"
        self.address, self.peer_address = f"{subnet}.1", f"{subnet}.2"
        try:
            _ip("netns", "add", self.name)
            _ip("link", "add", self.here, "type", "veth", "peer", "name", self.there)
            _ip("link", "set", self.there, "netns", self.name)
            _ip("addr", "add", f"{self.address}/30", "dev", self.here)
            _ip("link", "set", self.here, "up")
            _ip("-n", self.name, "addr", "add", f"{self.peer_address}/30", "dev", self.there)
            _ip("-n", self.name, "link", "set", self.there, "up")
            _ip("-n", self.name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.here], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)
