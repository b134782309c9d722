"""``kvbridge serve`` in a subprocess, for tests that need a real server process."""

from __future__ import annotations

import signal
import subprocess
import sys

from kvbridge.store import StoreClient
from kvbridge.tools._serve_cmds import read_listening


class ServeProcess:
    """A running ``kvbridge serve``; ``address`` (and the whole ``line``) is read from its
    first line. ``--port 0`` unless the arguments name a port."""

    def __init__(self, *args: str) -> None:
        port = () if "--port" in args else ("--port", "0")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvbridge", "serve", *port, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        try:
            self.address, self.line = read_listening(self.proc.stdout)
        except RuntimeError:
            assert self.proc.stderr is not None
            raise AssertionError(self.proc.stderr.read()) from None

    def stop(self, sig: int = signal.SIGTERM) -> str:
        """Signal the server and wait for it; its standard output."""
        self.proc.send_signal(sig)
        out, _ = self.proc.communicate(timeout=30)
        return str(out)

    def stop_and_read_log(self) -> str:
        """Stop the server; its log (standard error), read only now."""
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=30)
        return str(err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.stop(signal.SIGKILL)


BLOCK = 64 << 10
SLOTS = 8
"""The small server of the trust tests: ``SLOTS`` memory slots per namespace, 2 namespaces."""


def small_server() -> ServeProcess:
    """A server whose namespaces have ``SLOTS`` slots of ``BLOCK`` bytes, 30 s leases and no
    handoff holds: slot reuse is forced quickly and nothing expires by itself."""
    return ServeProcess(
        *("--host-capacity", str(2 * SLOTS * BLOCK), "--max-namespaces", "2"),
        *("--lease-ttl", "30", "--handoff-ttl", "0"),
    )


def client_of(server: ServeProcess, namespace: str = "m") -> StoreClient:
    """A client of ``server``'s namespace, with the small server's block size."""
    return StoreClient(server.address, block_bytes=BLOCK, namespace=namespace)
