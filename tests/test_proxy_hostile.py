"""``kvbridge proxy`` attacked by strangers, each test acting as the attacker does against
the proxy process an operator runs, in front of vLLM-like instances on real sockets:
thousands of connections that send half a request head and then nothing; heads, bodies
and keep-alive connections that never end; a stderr nobody reads; a client that sends its
own ``kv_transfer_params`` and request ids. The raw wire is built on purpose by
``proxy_support.hold_half_heads`` and ``raw_exchange``, and the sockets below."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import resource
import select
import socket
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from helpers import until as wait_until

pytest.importorskip("aiohttp", reason="kvbridge proxy needs aiohttp (the proxy extra)")
from aiohttp import ClientSession
from proxy_support import (
    FakeVllm,
    Metrics,
    ProxyProcess,
    closed_by_peer,
    completion,
    hold_half_heads,
    post,
    raw_exchange,
    scrape,
    settled,
    until,
    until_async,
    whole_stream,
)

from kvbridge.tools._proxy_log import ProxyLog

FLOOD = 6_500
HOST_FILES = (1024, 6144)
"""A host's usual soft open-files limit, and a hard one of 6,144 (the proxy raises its soft
limit up to it): the flood is more connections than the proxy has descriptors."""
LOG_LINES_AT_MOST = 50
"""The proxy's whole log in the flood test: its start, a line per request the test makes,
and one line per kind of warning; before the fix, one traceback per failed accept (72,096
of them, 34 MB, in one run)."""
QUICK = ("--head-timeout", "0.5", "--idle-timeout", "0.5")


@asynccontextmanager
async def _front(
    tmp_path: Path, *flags: str, **process: Any
) -> AsyncIterator[tuple[ProxyProcess, FakeVllm, FakeVllm]]:
    """A prefill and a decode fake, and the proxy process in front of them."""
    prefill, decode = FakeVllm("prefill"), FakeVllm("decode")
    await prefill.start()
    await decode.start()
    proxy = ProxyProcess([prefill.url], [decode.url], tmp_path / "proxy.log", *flags, **process)
    try:
        await proxy.start()
        yield proxy, prefill, decode
    finally:
        await prefill.stop()
        await decode.stop()
        assert await proxy.stop() == 0, proxy.log()


async def _served(url: str, what: str, **fields: Any) -> None:
    """A streamed completion is answered in full within 5 s (a liveness bound)."""
    async with ClientSession() as session:
        task = asyncio.create_task(post(session, f"{url}/v1/completions", completion(**fields)))
        ((status, data),) = await settled([task], what, timeout=5)
    assert status == 200 and whole_stream(data), (status, data[:200])


def _room_for(files: int) -> None:
    """Raise this process's soft open-files limit to ``files`` (skip where it cannot)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < files:
        pytest.skip(f"needs {files} open files, the hard limit is {hard}")
    if soft != resource.RLIM_INFINITY and soft < files:
        resource.setrlimit(resource.RLIMIT_NOFILE, (files, hard))


def _closed(metrics: Metrics, reason: str) -> float:
    return metrics.value("kvbridge_proxy_client_connections_closed_total", reason=reason)


# -- a flood of half heads ----------------------------------------------------------------


@pytest.mark.slow
def test_a_half_head_flood_does_not_stop_completions_and_the_log_stays_bounded(
    tmp_path: Path,
) -> None:
    """6,500 connections each send half a request head and hold it, more than the
    proxy's 6,144 descriptors, then 6,500 more: completions are answered, after the first
    burst and during the second (each on a connection of its own), the quietest
    connections past the cap were closed, and the proxy's log is a few dozen lines.
    (Before: every descriptor taken, every completion timed out, a traceback per failed
    accept.)"""
    _room_for(2 * FLOOD + 1024)
    asyncio.run(_half_head_flood(tmp_path))


async def _half_head_flood(tmp_path: Path) -> None:
    async with _front(tmp_path, files=HOST_FILES) as (proxy, _, _):
        held = await _strangers(proxy.port, FLOOD)
        try:
            assert len(held) > HOST_FILES[1], f"only {len(held)} connections held"
            for i in range(5):
                await _served(proxy.url, f"completion {i} under the flood")
            pushed_out = _closed(await scrape(proxy.url), "over_cap")
            assert pushed_out > 0
            more = asyncio.create_task(_strangers(proxy.port, FLOOD))
            await until_async(
                partial(_pushes_out_more, proxy.url, pushed_out), "the second burst under way"
            )
            for i in range(5):  # each on a connection accepted amid the second burst
                await _served(proxy.url, f"completion {i} during a second burst")
            held += await more
        finally:
            for sock in held:
                sock.close()
    lines = proxy.log().splitlines()
    assert len(lines) <= LOG_LINES_AT_MOST, "\n".join(lines[:20])
    assert sum("past the cap" in line for line in lines) >= 1, "\n".join(lines)


async def _strangers(port: int, count: int) -> list[socket.socket]:
    """``hold_half_heads`` as another program would run it: on an event loop and a thread
    of its own, so that the test's completions are not queued behind its connects. (On the
    test's loop, a completion's head waited up to 1 s behind 6,500 connects, and the burst
    pushed its silent connection out as the quietest: not the proxy's doing.)"""
    return await asyncio.to_thread(asyncio.run, hold_half_heads(port, count))


async def _pushes_out_more(url: str, than: float) -> bool:
    return _closed(await scrape(url), "over_cap") > than


# -- stderr that nobody reads -------------------------------------------------------------


@pytest.mark.slow
def test_stderr_on_a_pipe_nobody_reads_blocks_nothing(tmp_path: Path) -> None:
    """The proxy's stderr is a pipe nobody reads, and 64 requests with 4 KiB paths make
    256 KiB of log (the pipe takes 64 KiB at most): every request is still answered, completions
    too, and SIGTERM still ends the proxy with status 0. (Before: the event loop blocked in
    write(2) at the pipe's 64 KiB and never answered again.)"""
    asyncio.run(_stderr_unread(tmp_path))


async def _stderr_unread(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    try:
        async with _front(tmp_path, stderr=write_end) as (proxy, _, _):
            async with ClientSession() as session:
                for i in range(64):
                    path = f"/{i}-" + "x" * 4096
                    task = asyncio.create_task(session.get(f"{proxy.url}{path}"))
                    (answer,) = await settled([task], f"request {i} with a 4 KiB path", timeout=5)
                    assert answer.status == 404
                    answer.release()
            assert not _takes_more(write_end), "the pipe is not full: no attack"
            await _served(proxy.url, "a completion with stderr full")
    finally:
        os.close(read_end)
        os.close(write_end)


def _takes_more(fd: int) -> bool:
    """Whether a write to the pipe whose write end is ``fd`` would go through now."""
    return bool(select.select([], [fd], [], 0)[1])


# -- heads, bodies and keep-alive connections that never end ------------------------------


@pytest.mark.slow
def test_a_head_that_never_ends_is_closed_at_its_deadline(tmp_path: Path) -> None:
    """With ``--head-timeout 0.5``: half a head and then nothing, nothing at all, and a
    head trickled one byte every 0.1 s (never whole) are each closed by the proxy; a
    completion is answered meanwhile."""
    asyncio.run(_heads_that_never_end(tmp_path))


async def _heads_that_never_end(tmp_path: Path) -> None:
    async with _front(tmp_path, *QUICK) as (proxy, _, _):
        half, silent, trickle = (_connect(proxy.port) for _ in range(3))
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        trickling = asyncio.create_task(_trickle(trickle))
        await _served(proxy.url, "a completion beside them")
        socks = (half, silent, trickle)
        await until(lambda: all(closed_by_peer(s) for s in socks), "all three closed")
        assert await trickling > 5, "the trickle did not go on past the deadline"
        assert _closed(await scrape(proxy.url), "head_timeout") == 3
        for sock in socks:
            sock.close()


async def _trickle(sock: socket.socket) -> int:
    """Send a head one byte every 0.1 s (the attacker's pace) until the proxy closes the
    connection; the bytes sent."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 10_000
    for sent, byte in enumerate(head):
        try:
            sock.send(bytes([byte]))
        except OSError:
            return sent
        await asyncio.sleep(0.1)
    raise AssertionError("the proxy took 10,000 bytes of a head that never ends")


@pytest.mark.slow
def test_a_body_that_stops_is_cut_a_slow_one_is_not_and_idle_connections_close(
    tmp_path: Path,
) -> None:
    """With ``--head-timeout 0.5 --idle-timeout 0.5``: a body that stops after 10 of its
    100 bytes is cut; a body sent in pieces 0.2 s apart (1 s in all) is answered; a
    keep-alive connection left idle after its answer is closed."""
    asyncio.run(_bodies_and_idle(tmp_path))


async def _bodies_and_idle(tmp_path: Path) -> None:
    async with _front(tmp_path, *QUICK) as (proxy, _, _):
        stopped, idle = _connect(proxy.port), _connect(proxy.port)
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        stopped.sendall(f"{head}Content-Length: 100\r\n\r\n".encode() + b'{"model": ')
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _answer_head(idle)).startswith(b"HTTP/1.1 200")
        body = json.dumps(completion(stream=False)).encode()
        slow = await _slow_request(proxy.port, f"{head}Content-Length: {len(body)}\r\n", body)
        assert slow.startswith(b"HTTP/1.1 200"), slow[:200]
        await until(lambda: closed_by_peer(stopped) and closed_by_peer(idle), "both closed")
        metrics = await scrape(proxy.url)
        assert _closed(metrics, "body_timeout") == 1
        assert _closed(metrics, "idle_timeout") == 1
        stopped.close()
        idle.close()


async def _slow_request(port: int, head: str, body: bytes) -> bytes:
    """A whole request whose body comes in five pieces 0.2 s apart; the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"{head}Connection: close\r\n\r\n".encode())
        step = -(-len(body) // 5)
        for start in range(0, len(body), step):
            await asyncio.sleep(0.2)
            writer.write(body[start : start + step])
        return await asyncio.wait_for(reader.read(), 15)
    finally:
        writer.close()


async def _answer_head(sock: socket.socket) -> bytes:
    """The bytes of an answer that came on ``sock`` (a short one: it fits in one read)."""
    loop = asyncio.get_running_loop()
    return await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 5)


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)
    return sock


# -- the cap: the quietest waiting connection goes first ----------------------------------


@pytest.mark.slow
def test_past_the_cap_the_quietest_waiting_connection_goes_first(tmp_path: Path) -> None:
    """With ``--max-client-connections 4`` and a completion being answered (its decode
    holds the stream open): A and B send half a head, C finishes a request and idles.
    Each new connection then closes the waiting one silent the longest: A, then B, then
    C; the completion being answered is never closed, and ends whole."""
    asyncio.run(_quietest_first(tmp_path))


async def _quietest_first(tmp_path: Path) -> None:
    flags = ("--max-client-connections", "4", "--head-timeout", "60", "--idle-timeout", "60")
    async with _front(tmp_path, *flags) as (proxy, _, decode):
        await until_async(lambda: _others(proxy.port, 0), "no connection but the probe's")
        answering = asyncio.create_task(_streamed(proxy.url))
        await until(lambda: decode.in_progress == 1, "the completion at decode")
        a = _connect(proxy.port)
        a.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        await until_async(partial(_others, proxy.port, 2), "A's half head heard")
        b = _connect(proxy.port)  # after the probe: heard after A
        b.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        await until_async(partial(_others, proxy.port, 3), "B's half head heard")
        c = _connect(proxy.port)
        c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await _answer_head(c)).startswith(b"HTTP/1.1 200")
        newcomers = []
        for quietest, rest in ((a, (b, c)), (b, (c,)), (c, ())):
            newcomers.append(_connect(proxy.port))
            await until(partial(closed_by_peer, quietest), "the quietest closed")
            assert not any(closed_by_peer(sock) for sock in rest)
        decode.release()
        (streamed,) = await settled([answering], "the answered completion", 10)
        assert whole_stream(streamed)
        for sock in (a, b, c, *newcomers):
            sock.close()


async def _streamed(url: str) -> bytes:
    async with ClientSession() as session:
        status, data = await post(session, f"{url}/v1/completions", completion(decode="hold"))
        assert status == 200
        return data


async def _others(port: int, expected: int) -> bool:
    """Whether the proxy has ``expected`` client connections open besides this probe's
    own. The probe is a whole request, ``Connection: close``: the proxy has forgotten it
    before its next accept, and has heard every byte sent to it before the probe began."""
    probe = b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    text = (await raw_exchange(port, probe)).split(b"\r\n\r\n", 1)[1].decode()
    return Metrics(text).value("kvbridge_proxy_client_connections") == expected + 1


# -- what a client may not set: kv_transfer_params, request ids ----------------------------


@pytest.mark.slow
def test_a_clients_kv_transfer_params_and_request_ids_never_reach_the_instances(
    tmp_path: Path,
) -> None:
    """Two clients send the same ``X-Request-Id`` and body ``request_id``, and
    ``kv_transfer_params`` asking decode to wait for 1,000 blocks: neither instance sees
    any of them. Prefill and decode see one id the proxy made (another per request), decode
    sees only the prefill's parameters, none when the prefill failed; each client gets its
    own id back, and the proxy's."""
    asyncio.run(_client_fields(tmp_path))


async def _client_fields(tmp_path: Path) -> None:
    forged = {"kv_transfer_params": {"kvbridge_blocks": 1000}, "request_id": "victim-1"}
    async with _front(tmp_path) as (proxy, prefill, decode), ClientSession() as session:
        answers = []
        for fields in ({}, {"prefill": "500"}):
            body = {**completion(**fields), **forged}
            headers = {"X-Request-Id": "victim-1"}
            async with session.post(
                f"{proxy.url}/v1/completions", json=body, headers=headers
            ) as answer:
                assert answer.status == 200 and whole_stream(await answer.read())
                answers.append(answer.headers)
        seen = [*prefill.request_ids, *decode.request_ids]
        assert "victim-1" not in seen and len(set(prefill.request_ids)) == 2
        for sent in (*prefill.bodies, *decode.bodies):
            assert "request_id" not in sent
        for sent in prefill.bodies:
            assert "kv_transfer_params" not in sent
        first, second = decode.bodies
        assert first["kv_transfer_params"] == {"prefill": prefill.port, "rid": seen[0]}
        assert "kv_transfer_params" not in second  # its prefill failed: decode computes
        assert [headers["X-Request-Id"] for headers in answers] == ["victim-1"] * 2
        own = [headers["X-Kvbridge-Request-Id"] for headers in answers]
        assert prefill.request_ids == decode.request_ids == own


# -- the log itself: one line per kind, and no wait for a stuck stderr ----------------------


def test_ten_thousand_accept_errors_are_one_line_that_says_so() -> None:
    """asyncio's own handler reports 10,000 failed accepts (each names its socket) through
    the proxy's log: one line, with the error named; no traceback."""
    read_end, write_end = os.pipe()
    loop = asyncio.new_event_loop()
    try:
        with ProxyLog(logging.INFO, fd=write_end):
            for i in range(10_000):
                error = OSError(24, "Too many open files")
                loop.call_exception_handler(
                    {
                        "message": "socket.accept() out of system resource",
                        "exception": error,
                        "socket": f"<socket fd={i} laddr=('127.0.0.1', {40000 + i})>",
                    }
                )
        lines = os.read(read_end, 1 << 20).decode().splitlines()
    finally:
        loop.close()
        os.close(read_end)
        os.close(write_end)
    (line,) = lines
    assert "ERROR asyncio: socket.accept() out of system resource" in line
    assert "OSError: [Errno 24] Too many open files" in line


def test_a_log_whose_stderr_is_stuck_drops_counts_and_closes() -> None:
    """20,000 lines logged to a pipe nobody reads all return at once (the queue drops what
    does not fit, and counts it); once the pipe is read, lines say how many were dropped
    (each, how many since the last); ``close`` joins the writer's thread."""
    read_end, write_end = os.pipe()
    log = logging.getLogger("kvbridge.proxy.test")
    drained: list[bytes] = []
    reader = threading.Thread(target=_drain, args=(read_end, drained))
    try:
        with ProxyLog(logging.INFO, fd=write_end) as proxy_log:
            for i in range(20_000):
                log.info("line %d %s", i, "x" * 200)
            dropped = proxy_log.dropped
            assert dropped > 0
            reader.start()
            wait_until(lambda: _told_after(log, drained) >= dropped, "lines that say so")
        assert not any("_monitor" in thread.name for thread in threading.enumerate())
    finally:
        os.close(write_end)
        if reader.is_alive():
            reader.join(10)
        os.close(read_end)


def _drain(fd: int, into: list[bytes]) -> None:
    while chunk := os.read(fd, 1 << 16):
        into.append(chunk)


def _told_after(log: logging.Logger, drained: list[bytes]) -> int:
    """Log a line (a notice of the drops since the last one comes before the first line
    the queue has room for); the drops the notices read so far told of."""
    log.info("probe")
    told = re.findall(rb"(\d+) log lines dropped", b"".join(drained))
    return sum(int(count) for count in told)
