"""Two network namespaces joined by a veth pair, shaped with ``tc tbf`` (needs root and
iproute2). Used by ``kvbridge linkcheck``; everything it creates is named after this
process's pid and removed on exit, on an exception, on SIGINT/SIGTERM (turned into
exceptions by the caller), and by the next run if this one was killed outright.

The kernel this was written on has ``tbf`` and ``htb`` but no ``netem``: a link can be
limited in rate, not given added delay.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from .._closing import Closing

PREFIX = "kvb-"


class NetnsUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, or no ``ip``/``tc``)."""


def available() -> str | None:
    """``None`` when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "not root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` (install iproute2)"
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NetnsUnavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")


def names() -> list[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Delete namespaces left by linkchecks whose process is gone; return their names."""
    removed = []
    for name in names():
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX) :].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
            removed.append(name)
    return removed


class ShapedLink(Closing):
    """Namespaces ``a`` and ``b`` with addresses ``10.231.0.1`` and ``10.231.0.2``, each
    end's egress limited to ``rate_bits`` bits/s (``None``: unshaped)."""

    def __init__(self, rate_bits: float | None, *, index: int = 0) -> None:
        reason = available()
        if reason is not None:
            raise NetnsUnavailable(reason)
        pid = os.getpid()
        self.rate_bits = rate_bits
        self.namespaces = (f"{PREFIX}{pid}-{index}a", f"{PREFIX}{pid}-{index}b")
        self.devices = (f"kvb{pid % 100000}{index}a", f"kvb{pid % 100000}{index}b")
        self.addresses = ("10.231.0.1", "10.231.0.2")
        self._made: list[str] = []

    def __enter__(self) -> ShapedLink:
        try:
            for ns in self.namespaces:
                _ip("netns", "add", ns)
                self._made.append(ns)
            _ip("link", "add", self.devices[0], "type", "veth", "peer", "name", self.devices[1])
            for ns, dev, address in zip(self.namespaces, self.devices, self.addresses, strict=True):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{address}/30", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                if self.rate_bits is not None:
                    self._shape(ns, dev, self.rate_bits)
        except BaseException:
            self.close()
            raise
        return self

    @staticmethod
    def _shape(ns: str, dev: str, rate_bits: float) -> None:
        # The bucket holds 4 ms of traffic (at least 256 KiB): enough for a timer tick of
        # up to 250 Hz at full rate, small enough that bursts do not flatter the figures.
        burst = max(int(rate_bits / 8 / 250), 256 << 10)
        done = subprocess.run(
            [
                *("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf"),
                *("rate", f"{int(rate_bits)}bit", "burst", str(burst), "latency", "20ms"),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise NetnsUnavailable(f"tc tbf on {dev}: {done.stderr.strip()}")

    def command(self, side: int, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``side`` (0 or 1)."""
        return ["ip", "netns", "exec", self.namespaces[side], *argv]

    def close(self) -> None:
        """Delete the namespaces (the veth pair goes with them). Idempotent."""
        while self._made:
            subprocess.run(
                ["ip", "netns", "del", self._made.pop()], capture_output=True, check=False
            )
