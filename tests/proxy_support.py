"""What the ``kvbridge proxy`` tests share: vLLM-like upstreams on real sockets (in the test's
event loop, or as processes a test can SIGKILL), the proxy as the process an operator runs,
its metrics as numbers, and waits on conditions.

``FakeVllm`` answers ``/health``, ``/v1/models`` and the two completion routes. How it
answers a completion comes from the request body's ``"x_fake"`` object (``{"prefill":
mode, "decode": mode, "chunks": n, "usage": u}``; the proxy passes it through to both roles)
or, when set, from the fake's own ``mode``; an ``ok`` prefill answers ``u`` as its
``usage``. Modes:

- prefill: ``ok`` (a JSON object with ``kv_transfer_params``), ``list``, ``string``,
  ``number``, ``null``, ``notjson``, ``html``, ``noparams``, ``params_list``,
  ``truncated`` (half a JSON object), ``500``, ``stall`` (no answer until released);
- decode: ``ok`` (``chunks`` server-sent events and ``[DONE]`` when streamed, else one JSON
  object), ``stall`` (no status until released), ``hold`` (status and a first event, then
  nothing until released), ``trickle`` (an event every 20 ms, 500 of them), ``500``;
- both: ``drop`` (the connection closed before a status), ``cut`` (status and two events,
  then the connection closed).

A fake serves with ``handler_cancellation=True``, as vLLM aborts a request whose client
left: ``in_progress`` falls when the proxy closes a connection. Run as a script
(``python tests/proxy_support.py ROLE PORT``) it prints ``listening PORT`` and serves until
killed; ``GET /_stats`` says what it has in progress.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import ClientSession, ClientTimeout, web

# The rest of this module's imports are made where they are used: a fake's process (the
# soak starts them again and again) imports aiohttp only, and starts in half the time.
if TYPE_CHECKING:
    from kvbridge.tools._proxy_app import ProxyServer
    from kvbridge.tools._proxy_kv import KvRouting
    from kvbridge.tools._proxy_settings import ProxySettings

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
CHUNKS = 3
TRICKLE_EVENTS = 500


class FakeVllm:
    """A vLLM-like instance of one role on 127.0.0.1 (see the module's docstring)."""

    def __init__(self, role: str, port: int = 0, model: str = "fake-model") -> None:
        self.role = role
        self.port = port
        self.model = model
        self.mode: str | None = None
        self.health_status = 200
        self.health_hangs = False
        self.bodies: list[dict[str, Any]] = []
        self.request_ids: list[str] = []
        self.authorizations: list[str] = []
        self.in_progress = 0
        self.max_in_progress = 0
        self._released = asyncio.Event()
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> str:
        """Listen (again: on the same port after a ``stop``); the URL."""
        self._released = asyncio.Event()
        self._runner = web.AppRunner(self._app(), handler_cancellation=True, shutdown_timeout=1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        self.port = self._runner.addresses[0][1]
        return self.url

    async def stop(self) -> None:
        """Close the socket and every connection (stalled answers end)."""
        self.release()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def release(self) -> None:
        """Let every stalled or held answer go on, and later ones not stall (until the next
        ``start``)."""
        self._released.set()

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=256 << 20)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/_stats", self._stats)
        return app

    @property
    def connections(self) -> int:
        """Connections open to this fake (the proxy's, when only the proxy calls it)."""
        server = self._runner.server if self._runner is not None else None
        return len(server.connections) if server is not None else 0

    async def _health(self, request: web.Request) -> web.Response:
        if self.health_hangs:  # until the checker gives up and closes the connection
            await asyncio.Event().wait()
        return web.Response(status=self.health_status)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model}]})

    async def _stats(self, request: web.Request) -> web.Response:
        stats = {
            "in_progress": self.in_progress,
            "requests": len(self.bodies),
            "connections": self.connections - 1,  # less this request's own
        }
        return web.json_response(stats)

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.request_ids.append(request.headers.get("X-Request-Id", ""))
        self.authorizations.append(request.headers.get("Authorization", ""))
        self.in_progress += 1
        self.max_in_progress = max(self.max_in_progress, self.in_progress)
        try:
            fake = body.get("x_fake") or {}
            mode = self.mode or fake.get(self.role, "ok")
            answer = self._prefill if self.role == "prefill" else self._decode
            return await answer(request, body, mode, int(fake.get("chunks", CHUNKS)))
        finally:
            self.in_progress -= 1

    async def _prefill(
        self, request: web.Request, body: dict[str, Any], mode: str, chunks: int
    ) -> web.StreamResponse:
        params = {"prefill": self.port, "rid": request.headers.get("X-Request-Id")}
        usage = (body.get("x_fake") or {}).get("usage")
        ok = {"choices": [{"text": "x"}], "kv_transfer_params": params, "usage": usage}
        texts = {
            "ok": json.dumps(ok),
            "list": "[1, 2, 3]",
            "string": '"done"',
            "number": "7",
            "null": "null",
            "notjson": "not json at all",
            "noparams": json.dumps({"choices": [{"text": "x"}]}),
            "params_list": json.dumps({"kv_transfer_params": [1, 2]}),
            "truncated": '{"kv_transfer_params": {"a": ',
        }
        if mode in texts:
            return web.Response(text=texts[mode], content_type="application/json")
        if mode == "html":
            return web.Response(text="<html>busy</html>", content_type="text/html")
        return await self._common(request, mode, chunks)

    async def _decode(
        self, request: web.Request, body: dict[str, Any], mode: str, chunks: int
    ) -> web.StreamResponse:
        if mode == "ok" and not body.get("stream"):
            return web.json_response({"choices": [{"text": "decoded"}], "from": self.port})
        if mode in ("ok", "hold", "trickle"):
            count = TRICKLE_EVENTS if mode == "trickle" else chunks
            return await self._stream(request, count, hold=mode == "hold", pace=mode == "trickle")
        return await self._common(request, mode, chunks)

    async def _common(self, request: web.Request, mode: str, chunks: int) -> web.StreamResponse:
        if mode == "500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if mode == "stall":
            await self._released.wait()
            return web.json_response({"error": {"message": "released"}}, status=500)
        if mode == "drop":
            _close(request)
            return web.Response()
        if mode == "cut":
            response = await self._start_stream(request)
            for i in range(2):
                await response.write(_event(i))
            _close(request)
            return response
        raise AssertionError(f"no such {self.role} mode: {mode}")

    async def _start_stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_type = "text/event-stream"
        await response.prepare(request)
        return response

    async def _stream(
        self, request: web.Request, count: int, *, hold: bool, pace: bool
    ) -> web.StreamResponse:
        response = await self._start_stream(request)
        for i in range(count):
            await response.write(_event(i))
            if hold and i == 0:
                await self._released.wait()
            if pace:
                await asyncio.sleep(0.02)
        await response.write(b"data: [DONE]\n\n")
        return response


def _event(i: int) -> bytes:
    return f"data: {json.dumps({'choices': [{'text': f't{i}'}]})}\n\n".encode()


def _close(request: web.Request) -> None:
    if request.transport is not None:
        request.transport.close()


def whole_stream(data: bytes, chunks: int = CHUNKS) -> bool:
    """Whether ``data`` is a fake decode's whole streamed answer."""
    return data == b"".join(_event(i) for i in range(chunks)) + b"data: [DONE]\n\n"


async def until(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    """Wait until ``check()`` holds; fail the test (naming ``what``) past ``timeout``."""
    await until_async(_as_async(check), what, timeout)


async def until_async(
    check: Callable[[], Awaitable[bool]], what: str, timeout: float = 15.0
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.02)


async def settled(tasks: list[asyncio.Task[T]], what: str, timeout: float = 30.0) -> list[T]:
    """The results of ``tasks``; fail the test (naming ``what``) if they hang. When one
    fails or they hang, the others are cancelled and awaited first."""
    try:
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"not within {timeout} s: {what}") from None
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _as_async(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def checked() -> bool:
        return check()

    return checked


class Metrics:
    """One scrape of a proxy's ``/metrics``."""

    def __init__(self, text: str) -> None:
        from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

        self.samples: list[tuple[str, dict[str, str], float]] = [
            (sample.name, sample.labels, sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]

    def value(self, name: str, **labels: str) -> float:
        """The sum of the samples called ``name`` whose labels include ``labels``."""
        return sum(
            value
            for sample, have, value in self.samples
            if sample == name and all(have.get(k) == v for k, v in labels.items())
        )


async def scrape(url: str) -> Metrics:
    """The proxy's metrics, over a connection of its own."""
    async with ClientSession() as session, session.get(f"{url}/metrics") as answer:
        assert answer.status == 200, answer.status
        return Metrics(await answer.text())


async def post(
    session: ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """POST ``body`` (JSON, or bytes as they are); the status and the whole answer."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    async with session.post(url, data=data, headers=all_headers) as answer:
        return answer.status, await answer.read()


def completion(
    decode: str = "ok", prefill: str = "ok", usage: Any = None, **fields: Any
) -> dict[str, Any]:
    """A streamed completion request whose fakes answer as told (an ``ok`` prefill with
    ``usage`` as its usage)."""
    body = {"model": "fake-model", "prompt": [1, 2, 3], "max_tokens": 8, "stream": True}
    fake = {"prefill": prefill, "decode": decode, "usage": usage}
    return {**body, **fields, "x_fake": fake}


_WITH_FILES = (
    "import os, resource, sys; "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2]))); "
    "os.execv(sys.argv[3], sys.argv[3:])"
)
"""Run a command (``argv[3:]``) under the open-files limits ``argv[1]`` (soft) and
``argv[2]`` (hard)."""


class ProxyProcess:
    """``kvbridge proxy`` as an operator runs it: its own process, its log in a file (its
    stderr on ``stderr`` instead, a descriptor, when given); ``files``: its soft and hard
    open-files limits, as a host sets them (``ulimit -Sn``, ``-Hn``)."""

    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        log: Path,
        *flags: str,
        files: tuple[int, int] | None = None,
        stderr: int | None = None,
    ) -> None:
        from helpers import free_port  # noqa: PLC0415

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._args = [
            *(arg for url in prefill for arg in ("--prefill", url)),
            *(arg for url in decode for arg in ("--decode", url)),
            *flags,
        ]
        self._log_path = log
        self._files = files
        self._stderr = stderr
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    async def start(self) -> str:
        """Start it and wait until it serves (its ``/health`` says 200)."""
        command = [sys.executable, "-m", "kvbridge", "proxy", "--port", str(self.port)]
        if self._files is not None:
            limits = (str(limit) for limit in self._files)
            command = [sys.executable, "-c", _WITH_FILES, *limits, *command]
        with self._log_path.open("wb") as log:
            self._proc = await asyncio.create_subprocess_exec(
                *command,
                *self._args,
                stdout=log,
                stderr=log if self._stderr is None else self._stderr,
                cwd=ROOT,
            )
        await until_async(self._serves, f"the proxy serves ({self.log()})", timeout=30)
        return self.url

    async def _serves(self) -> bool:
        assert self._proc is not None and self._proc.returncode is None, self.log()
        try:
            async with (
                ClientSession(timeout=ClientTimeout(total=5)) as session,
                session.get(f"{self.url}/health") as answer,
            ):
                return answer.status == 200
        except (OSError, asyncio.TimeoutError):
            return False

    async def stop(self) -> int:
        """SIGTERM, then its exit status (SIGKILL after 30 s)."""
        if self._proc is None:
            return 0
        if self._proc.returncode is not None:
            return self._proc.returncode
        self._proc.send_signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(self._proc.wait(), 30)
        except asyncio.TimeoutError:
            self._proc.kill()
            return await self._proc.wait()

    def log(self) -> str:
        return self._log_path.read_text(errors="replace")


HALF_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
"""What a slowloris sends: a request line and a header, and never the end of the head."""


async def hold_half_heads(port: int, count: int, within: float = 30.0) -> list[socket.socket]:
    """The attacker: ``count`` connections to ``port`` on 127.0.0.1, all opened at once,
    each sent ``HALF_HEAD`` and then nothing. The ones open within ``within`` s come back,
    to hold (and close) as the caller likes."""
    loop = asyncio.get_running_loop()
    held: list[socket.socket] = []

    async def one() -> None:
        sock = socket.socket()
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, ("127.0.0.1", port))
            await loop.sock_sendall(sock, HALF_HEAD)
        except (OSError, asyncio.CancelledError):
            sock.close()
            raise
        held.append(sock)

    tries = [asyncio.create_task(one()) for _ in range(count)]
    _, late = await asyncio.wait(tries, timeout=within)
    for task in late:
        task.cancel()
    await asyncio.gather(*tries, return_exceptions=True)
    return held


async def raw_exchange(port: int, request: bytes) -> bytes:
    """Send ``request`` (a whole one, ``Connection: close``) on a connection of its own and
    read until the proxy closes it: the proxy has forgotten the connection by then."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        return await asyncio.wait_for(reader.read(), 15)
    finally:
        writer.close()


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed ``sock`` (a non-blocking one): EOF or a reset, after
    what bytes came before it (read and dropped). Never waits."""
    try:
        while sock.recv(1 << 16):
            pass
    except BlockingIOError:
        return False
    except ConnectionError:
        return True
    return True


class UpstreamProcess:
    """A ``FakeVllm`` in a process of its own, to be SIGKILLed and started again on its
    port."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.port = 0
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> str:
        self._proc = await asyncio.create_subprocess_exec(
            *(sys.executable, __file__, self.role, str(self.port)),
            stdout=asyncio.subprocess.PIPE,
            cwd=ROOT,
        )
        assert self._proc.stdout is not None
        line = await asyncio.wait_for(self._proc.stdout.readline(), 30)
        assert line.startswith(b"listening "), line
        self.port = int(line.split()[1])
        return self.url

    async def kill(self) -> None:
        if self.alive:
            assert self._proc is not None
            self._proc.send_signal(signal.SIGKILL)
            await self._proc.wait()

    async def stats(self) -> dict[str, int]:
        async with ClientSession() as session, session.get(f"{self.url}/_stats") as answer:
            stats: dict[str, int] = await answer.json()
            return stats


async def _serve_forever(role: str, port: int) -> None:
    fake = FakeVllm(role, port)
    await fake.start()
    print(f"listening {fake.port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":  # tests/ is on sys.path: helpers imports
    asyncio.run(_serve_forever(sys.argv[1], int(sys.argv[2])))


class Deployment:
    """Fake instances of both roles and the proxy in front of them, in the test's event
    loop (the proxy served by ``ProxyServer``, as ``kvbridge proxy`` serves it)."""

    def __init__(
        self,
        prefills: int = 1,
        decodes: int = 1,
        settings: ProxySettings | None = None,
        kv: Callable[[list[str]], KvRouting] | None = None,
    ) -> None:
        """``kv``: makes ``--route kv``'s routing for the prefill fakes' URLs (the test
        closes it)."""
        self.prefills = [FakeVllm("prefill") for _ in range(prefills)]
        self.decodes = [FakeVllm("decode", model=f"model-{i}") for i in range(decodes)]
        self._settings = settings
        self._kv = kv
        self.kv: KvRouting | None = None
        self._server: ProxyServer | None = None
        self.url = ""

    async def __aenter__(self) -> Deployment:
        from kvbridge.tools._proxy_app import ProxyServer, make_app  # noqa: PLC0415

        for fake in (*self.prefills, *self.decodes):
            await fake.start()
        urls = [fake.url for fake in self.prefills]
        self.kv = None if self._kv is None else self._kv(urls)
        app = make_app(urls, [fake.url for fake in self.decodes], self._settings, self.kv)
        self._server = ProxyServer(app, shutdown_grace=1)
        self.url = await self._server.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for fake in (*self.prefills, *self.decodes):
            await fake.stop()
        if self._server is not None:
            await self._server.close()
        if self.kv is not None:
            self.kv.close()

    async def metrics(self) -> Metrics:
        return await scrape(self.url)
