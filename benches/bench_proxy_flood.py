"""A client's completion latency through ``kvbridge proxy`` while strangers hold half request
heads (issue 32), against the same client on the same proxy, idle, in the same run.

The proxy runs as an operator runs it, held to 6,144 open files (a soft limit of 1,024
that it raises to a hard one of 6,144), in front of a prefill and a decode fake (vLLM-like,
each its own process: ``tests/proxy_support.py``). The flood is this file run as a script,
a process of its own: 6,500 connections that each send half a request head and then
nothing (more than the proxy has descriptors), reopening each one the proxy closes at up to
1,000 a second. The client: 300 streamed completions in a row on one keep-alive connection,
timed from the request to the answer's last byte; first with no flood, then under it.
ratio = idle p50 / flooded p50 (1.0: the flood costs nothing).

Run: ``cd benches && python -m pytest -q -s bench_proxy_flood.py``.
"""

from __future__ import annotations

import asyncio
import resource
import socket
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "tests"))

FLOOD = 6_500
REOPEN_PER_S = 1_000
COMPLETIONS = 300
HOST_FILES = (1024, 6144)
HALF_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"


@pytest.fixture(scope="module")
def proxy_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A running proxy in front of two fake instances (processes), for the module."""
    pytest.importorskip("aiohttp", reason="kvbridge proxy needs aiohttp (the proxy extra)")
    loop = asyncio.new_event_loop()
    front = _front(tmp_path_factory.mktemp("proxy") / "proxy.log")
    try:
        yield loop.run_until_complete(anext(front))
    finally:
        loop.run_until_complete(front.aclose())
        loop.close()


async def _front(log: Path) -> AsyncGenerator[int, None]:
    from proxy_support import ProxyProcess, UpstreamProcess  # noqa: PLC0415

    prefill, decode = UpstreamProcess("prefill"), UpstreamProcess("decode")
    await prefill.start()
    await decode.start()
    proxy = ProxyProcess([prefill.url], [decode.url], log, files=HOST_FILES)
    try:
        await proxy.start()
        yield proxy.port
    finally:
        await proxy.stop()
        await prefill.kill()
        await decode.kill()


def test_completion_latency_under_a_half_head_flood(proxy_port: int) -> None:
    from conftest import _EXTRA_LINES  # noqa: PLC0415

    idle = asyncio.run(_latencies(proxy_port))
    flood = subprocess.Popen(
        [sys.executable, __file__, str(proxy_port), str(FLOOD), str(REOPEN_PER_S)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert flood.stdin is not None and flood.stdout is not None
    try:
        up = flood.stdout.readline().split()
        assert up[0] == "up", up
        flooded = asyncio.run(_latencies(proxy_port))
        closed = asyncio.run(_closed_by_proxy(proxy_port))
    finally:
        flood.stdin.close()
        opened = flood.stdout.readline().split()
        flood.wait(60)
    base = float(np.percentile(idle, 50))
    line = (
        f"proxy completion under {FLOOD:,} half heads ({int(opened[1]):,} opened in all, "
        f"{closed:,} closed by the proxy): p50 {np.percentile(flooded, 50):.2f} ms "
        f"p99 {np.percentile(flooded, 99):.2f} ms; idle p50 {base:.2f} ms "
        f"p99 {np.percentile(idle, 99):.2f} ms; ratio {base / np.percentile(flooded, 50):.2f}"
    )
    _EXTRA_LINES.append(line)
    print(line)


async def _closed_by_proxy(port: int) -> int:
    """Client connections the proxy has closed (its metrics: over the cap, deadlines)."""
    from proxy_support import scrape  # noqa: PLC0415

    metrics = await scrape(f"http://127.0.0.1:{port}")
    return int(metrics.value("kvbridge_proxy_client_connections_closed_total"))


async def _latencies(port: int) -> np.ndarray:
    """Milliseconds per streamed completion, ``COMPLETIONS`` in a row (after 20 unmeasured)."""
    from aiohttp import ClientSession, ClientTimeout  # noqa: PLC0415
    from proxy_support import completion, post, whole_stream  # noqa: PLC0415

    url = f"http://127.0.0.1:{port}/v1/completions"
    times = []
    async with ClientSession(timeout=ClientTimeout(total=30)) as session:
        for i in range(20 + COMPLETIONS):
            start = time.perf_counter()
            status, data = await post(session, url, completion())
            if i >= 20:
                times.append(time.perf_counter() - start)
            assert status == 200 and whole_stream(data), status
    return np.array(times) * 1e3


# -- the flood, run as a script: PORT COUNT REOPEN_PER_S ------------------------------------


async def _flood(port: int, count: int, per_s: float) -> None:
    """Hold ``count`` half heads on ``port``, reopening each closed one (at most ``per_s``
    opens a second once the first ``count`` are up), until stdin closes; print ``up`` once
    the first round is up (or after 30 s), and ``opened N`` at the end."""
    loop = asyncio.get_running_loop()
    opened = [0]
    pace = _Pace(per_s)
    up = asyncio.Event()

    async def hold() -> None:
        while True:
            if up.is_set():
                await pace.wait()
            sock = socket.socket()
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, ("127.0.0.1", port))
                await loop.sock_sendall(sock, HALF_HEAD)
                opened[0] += 1
                await _closed(loop, sock)
            except OSError:
                pass
            finally:
                sock.close()

    holders = [asyncio.create_task(hold()) for _ in range(count)]
    deadline = loop.time() + 30
    while opened[0] < count and loop.time() < deadline:
        await asyncio.sleep(0.05)
    up.set()
    print("up", flush=True)
    await loop.run_in_executor(None, sys.stdin.read)
    for task in holders:
        task.cancel()
    await asyncio.gather(*holders, return_exceptions=True)
    print(f"opened {opened[0]}", flush=True)


async def _closed(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Until the proxy closes ``sock``."""
    while await loop.sock_recv(sock, 1 << 12):
        pass


class _Pace:
    """At most ``per_s`` passes a second, in turn."""

    def __init__(self, per_s: float) -> None:
        self._gap = 1 / per_s
        self._next = 0.0

    async def wait(self) -> None:
        now = time.monotonic()
        self._next = max(self._next + self._gap, now)
        if self._next > now:
            await asyncio.sleep(self._next - now)


if __name__ == "__main__":
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    asyncio.run(_flood(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))
