"""``kvbridge serve`` in a subprocess, for tests that need a real server process; the small
server of the trust tests (in a process, or in this one for tests that reach inside it);
the transports every trust and fault test runs over; waiting on a condition."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pytest
from helpers import until
from nixl_lane import NIXL_LANE

from kvbridge.store import CacheServer, ServerConfig, StoreClient
from kvbridge.tools._serve_cmds import read_listening
from kvbridge.transfer import Caller, nixl_available, ucx_available

if TYPE_CHECKING:
    from kvbridge.store.server._namespaces import Namespace

needs_ucx = pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed (kvbridge[ucx])")
needs_nixl = pytest.mark.skipif(
    not nixl_available(), reason="NIXL is not installed (pip install --no-deps nixl-cu12)"
)

TRANSPORTS = (
    [pytest.param("nixl", marks=needs_nixl)]
    if NIXL_LANE
    else ["tcp", pytest.param("ucx", marks=needs_ucx)]
)
"""What holds over TCP holds over UCX, and over nixl where a one-sided transport can hold it:
parametrize a ``transport`` fixture with these (the UCX and nixl cases skip, saying why,
where ucxx or NIXL is missing; a case nixl cannot make skips with ``ONE_SIDED``). The nixl
cases run in the nixl lane's process (``nixl_lane.py``), the others in the main one."""

ONE_SIDED = (
    "one-sided (nixl): a client writes and reads the server's memory itself, so the server "
    "cannot refuse an op (docs/ACCESS.md, 'nixl'): the client's own checks stand in for it"
)


def no_tenants_over(transport: str) -> None:
    """Skip a case of a server with tenants over nixl, which such a server refuses."""
    if transport == "nixl":
        pytest.skip("a server with tenants refuses nixl (one trust domain): test_nixl_server")


def two_sided(transport: str) -> None:
    """Skip a case only a transport whose target checks every op can make."""
    if transport == "nixl":
        pytest.skip(ONE_SIDED)


class Served(Protocol):
    """A server clients reach at ``address``: a :class:`ServeProcess` or a ``CacheServer``."""

    @property
    def address(self) -> str: ...


class ServeProcess:
    """A running ``kvbridge serve``; ``address`` (and the whole ``line``) is read from its
    first line. ``--port 0`` unless the arguments name a port."""

    def __init__(
        self,
        *args: str,
        open_files: tuple[int, int] | None = None,
        inside: Sequence[str] = (),
    ) -> None:
        """``open_files``: the server's open-files limits (soft, hard) as it starts.
        ``inside``: what the command runs under (``ip netns exec NAME``)."""
        port = () if "--port" in args else ("--port", "0")
        command = [sys.executable, "-m", "kvbridge", "serve", *port, *args]
        if open_files is not None:  # set in the child before it runs the server (no preexec_fn)
            command = [sys.executable, "-c", _LIMITED, *map(str, open_files), *command]
        command = [*inside, *command]
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
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

    def freeze(self) -> None:
        """SIGSTOP the server and wait until every thread of it has stopped: a signal takes
        effect asynchronously, and a thread still running (on the other core) could answer a
        request sent just after the signal."""
        self.proc.send_signal(signal.SIGSTOP)
        until(self.stopped, "every thread of the server stopped", timeout=10)

    def rss(self) -> int:
        """The server's resident memory now (``VmRSS`` from ``/proc``), in bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS in /proc")

    def open_files(self) -> int:
        """The server's soft open-files limit now (from ``/proc``)."""
        for line in Path(f"/proc/{self.proc.pid}/limits").read_text().splitlines():
            if line.startswith("Max open files"):
                return int(line.split()[3])
        raise AssertionError("no open-files limit in /proc")

    def stopped(self) -> bool:
        """Whether every thread of the server is stopped (SIGSTOP took effect)."""
        tasks = Path(f"/proc/{self.proc.pid}/task").glob("*/stat")
        states = [stat.read_text().rsplit(")", 1)[1].split()[0] for stat in tasks]
        return bool(states) and all(state in "Tt" for state in states)


BLOCK = 64 << 10
SLOTS = 8
"""The small server of the trust tests: ``SLOTS`` memory slots per namespace, 2 namespaces."""


_LIMITED = (
    "import os, resource, sys; "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2]))); "
    "os.execv(sys.argv[3], sys.argv[3:])"
)
"""Sets the open-files limits given first, then becomes the command that follows."""


def small_server(transport: str = "tcp") -> ServeProcess:
    """A server whose namespaces have ``SLOTS`` slots of ``BLOCK`` bytes, 30 s leases and no
    handoff holds: slot reuse is forced quickly and nothing expires by itself. Its data
    streams are ``transport``'s."""
    return ServeProcess(
        *("--host-capacity", str(2 * SLOTS * BLOCK), "--max-namespaces", "2"),
        *("--lease-ttl", "30", "--handoff-ttl", "0", "--transports", transport),
    )


def small_config(transport: str = "tcp") -> ServerConfig:
    """:func:`small_server`'s settings, for a ``CacheServer`` in this process."""
    return ServerConfig(
        port=0,
        host_capacity=2 * SLOTS * BLOCK,
        max_namespaces=2,
        lease_ttl=30,
        handoff_ttl=0,
        transports=(transport,),
    )


def client_of(server: Served, namespace: str = "m", transports: str = "tcp") -> StoreClient:
    """A client of ``server``'s namespace, with the small server's block size, whose data
    streams are ``transports``'."""
    return StoreClient(
        server.address, block_bytes=BLOCK, namespace=namespace, transports=transports
    )


def namespaces(server: CacheServer) -> list[Namespace]:
    """The namespaces an in-process server has open (their stores, holds and leases), for
    tests that check what a request left behind inside it."""
    return list(server._namespaces.snapshot())


def handle(server: CacheServer, caller: Caller, body: dict[str, Any]) -> dict[str, Any]:
    """Answer ``body`` as the server's request handler would for ``caller`` (a session the
    engine never saw, say), without the wire."""
    return server._handle(caller, body)
