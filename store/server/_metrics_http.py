"""The metrics endpoint's HTTP server: one thread, every connection bounded.

Prometheus scrapes ``GET /metrics`` now and then; anyone who can reach the port can also
open connections and say nothing (a slow loris). So the endpoint is one thread running an
asyncio loop, not a thread per connection: a connection costs a socket and a little memory,
must send its request head within :data:`HEAD_TIMEOUT_S`, may be one of at most
:data:`MAX_CONNECTIONS` (past that, the connection silent the longest is closed to make
way: a scraper speaks within a round trip, so only a flood of new connections faster than
that can push one out, which an attack review saw for 8 of 6,502 scrapes under two
flooding processes; Prometheus scrapes again at its next interval), and is
answered only once its bearer token checks out. ``close()`` stops the loop and joins the
thread; connections still open are closed with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable

HEAD_TIMEOUT_S = 5.0
"""A connection must send its whole request head within this (Prometheus sends at once)."""
WRITE_TIMEOUT_S = 10.0
"""An answer must be taken within this (a scrape of many namespaces is a few hundred KiB)."""
MAX_CONNECTIONS = 64
"""Connections open at once; a scraper needs one, a handful of scrapers a few."""
MAX_HEAD_BYTES = 8 << 10
"""The request line and headers of a scrape are a few hundred bytes."""

Render = Callable[[], tuple[bytes, str]]
"""``render() -> (body, content type)``: the metrics text, made when a scrape asks."""


class MetricsHTTP:
    """Serves ``render()`` at ``GET /metrics`` (and ``/``) on ``host:port``; with ``token``,
    only to requests carrying ``Authorization: Bearer <token>``."""

    def __init__(self, host: str, port: int, render: Render, *, token: str | None) -> None:
        self._render = render
        self._expected = None if token is None else f"Bearer {token}".encode()
        self._waiting: OrderedDict[asyncio.StreamWriter, None] = OrderedDict()
        """Connections still to send their request head, oldest first."""
        self._open: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvbridge-metrics", daemon=True
        )
        self._thread.start()
        try:
            started = asyncio.run_coroutine_threadsafe(self._listen(host, port), self._loop)
            self._server = started.result()
        except BaseException:
            self._stop_loop()
            raise
        self.port = int(self._server.sockets[0].getsockname()[1])

    def close(self) -> None:
        """Stop listening, close every connection, stop the loop and join its thread."""
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result()
        self._stop_loop()

    # -- the loop's side ---------------------------------------------------------------

    async def _listen(self, host: str, port: int) -> asyncio.Server:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return await asyncio.start_server(
            self._serve, host, port, family=family, limit=MAX_HEAD_BYTES
        )

    async def _shutdown(self) -> None:
        self._server.close()
        for writer in list(self._open):
            writer.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._admit(writer)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            self._waiting.pop(writer, None)
            status, headers, body = self._answer(head)
            writer.write(_response(status, headers, body, head.startswith(b"HEAD ")))
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # silent, slow, too long or gone: only this connection ends
        finally:
            self._waiting.pop(writer, None)
            self._open.discard(writer)
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    def _admit(self, writer: asyncio.StreamWriter) -> None:
        """Count a new connection; past the cap, close the one silent the longest."""
        if len(self._open) >= MAX_CONNECTIONS and self._waiting:
            oldest, _ = self._waiting.popitem(last=False)
            oldest.close()  # its read fails at once; its task ends it
        self._open.add(writer)
        self._waiting[writer] = None

    def _answer(self, head: bytes) -> tuple[str, list[tuple[str, str]], bytes]:
        lines = head.split(b"\r\n")
        parts = lines[0].split()
        if len(parts) != 3 or parts[0] not in (b"GET", b"HEAD"):
            return "405 Method Not Allowed", [("Allow", "GET")], b"GET /metrics\n"
        if self._expected is not None and not hmac.compare_digest(
            _authorization(lines[1:]), self._expected
        ):
            return (
                "401 Unauthorized",
                [("WWW-Authenticate", "Bearer")],
                b"a bearer token is required\n",
            )
        if parts[1].split(b"?")[0] not in (b"/metrics", b"/"):
            return "404 Not Found", [], b"metrics are at /metrics\n"
        body, content_type = self._render()
        return "200 OK", [("Content-Type", content_type)], body


def _authorization(header_lines: list[bytes]) -> bytes:
    for line in header_lines:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"authorization":
            return value.strip()
    return b""


def _response(status: str, headers: list[tuple[str, str]], body: bytes, head_only: bool) -> bytes:
    """The answer's bytes; to a HEAD, the length a GET would get, without the body."""
    head = [f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", "Connection: close"]
    head += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + (b"" if head_only else body)
