"""The proxy as an aiohttp application (``make_app``) and the server that runs it as
``kvbridge proxy`` does (``ProxyServer``).

Routes: ``POST /v1/completions`` and ``/v1/chat/completions`` (prefill, then decode: see
``_proxy_forward``); ``GET /v1/models`` (a healthy decode instance's); ``GET /health`` (200
while some decode instance is healthy, body ``status`` ``ok`` or ``degraded`` when any
instance is out; 503 ``unavailable`` when no decode instance is); ``GET /metrics``
(Prometheus text: ``_proxy_metrics``).

The proxy owns a request's id and its ``kv_transfer_params``: it makes an id for each
request (the instances see it as ``X-Request-Id``; a client's comes back in the answer
only) and drops a client's ``PROXY_FIELDS``.

The app owns its parts: ``Upstreams`` (connection pools and the health checker task) starts
with the app and is closed, its task cancelled and awaited, on cleanup; ``ClientConnections``
(``app[CLIENTS]``: the client connections' deadlines and cap), which ``ProxyServer`` feeds
and the handlers tell when a request starts, is read and ends. A client that goes
away is counted, logged at debug level, and ends its request: serve the app with
``handler_cancellation=True`` (``ProxyServer`` does, as does aiohttp's ``TestServer``) so
that a client gone while an upstream is silent cancels the upstream request too.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from aiohttp import hdrs, web

from ._proxy_clients import ClientConnections, GuardedSite
from ._proxy_forward import ClientGone, Forwarder, error_response, from_json, to_json
from ._proxy_metrics import CONTENT_TYPE, ProxyMetrics
from ._proxy_settings import (
    ACCEPTS_PER_TURN,
    LISTEN_BACKLOG,
    ProxySettings,
    client_room,
    soft_open_files,
    upstream_urls,
)
from ._proxy_upstreams import Upstreams

if TYPE_CHECKING:
    from ._proxy_kv import KvRouting

_log = logging.getLogger("kvbridge.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
CLIENT_GONE = 499
"""The status counted for a request whose client went away first (nginx's convention)."""

_REQUEST_ID: ContextVar[str] = ContextVar("kvbridge_proxy_request_id")
"""The id the proxy made for the request (the upstreams see it, never the client's), set
by ``observe``: aiohttp runs each request in a task of its own, so each sees its own."""

PROXY_FIELDS = ("kv_transfer_params", "request_id")
"""Body fields the proxy owns; a client's are dropped. ``kv_transfer_params`` from a client
could make decode wait ``pd_wait`` for blocks nobody saved (the proxy sets decode's from
the prefill's answer); ``request_id`` is vLLM's id for a request that comes without an
``X-Request-Id`` header (the proxy always sends its own header, and drops the field too so
that a client's id never names a request upstream)."""

CLIENTS: web.AppKey[ClientConnections] = web.AppKey("kvbridge_proxy_clients", ClientConnections)
"""The app's client connections ledger, which ``ProxyServer`` feeds."""

SHUTDOWN_GRACE_S = 30.0
"""On stop, answers in flight get this long to end before they are cut."""

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_app(
    prefill: Sequence[str],
    decode: Sequence[str],
    settings: ProxySettings | None = None,
    kv: KvRouting | None = None,
) -> web.Application:
    """The proxy in front of these prefill and decode instances (URLs; ``ValueError`` names
    a bad one); ``kv``: prefill instances chosen by their caches (``--route kv``; its owner
    closes it)."""
    settings = settings or ProxySettings()
    upstreams = Upstreams(
        upstream_urls("prefill", list(prefill)), upstream_urls("decode", list(decode)), settings
    )
    clients = ClientConnections(
        _client_cap(settings, upstreams), settings.head_timeout, settings.idle_timeout
    )
    proxy = _Proxy(upstreams, clients, settings, kv)
    app = web.Application(client_max_size=settings.max_body, middlewares=[proxy.observe])
    app[CLIENTS] = clients
    app.cleanup_ctx.append(proxy.lifetime)
    app.on_shutdown.append(proxy.shutting_down)
    app.on_response_prepare.append(_tag)
    for route in ROUTES:
        app.router.add_post(route, proxy.completions)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/metrics", proxy.metrics_text)
    return app


def _client_cap(settings: ProxySettings, upstreams: Upstreams) -> int:
    """``settings.max_clients``, or as many as this process's open-files limit leaves room
    for (``kvbridge proxy`` raises the limit first, and caps the flag by it)."""
    if settings.max_clients is not None:
        return settings.max_clients
    instances = len(upstreams.instances())
    upstream = instances * settings.connections_per_instance
    return client_room(soft_open_files(), upstream, instances)


class _Proxy:
    """The handlers, and the state they share."""

    def __init__(
        self,
        upstreams: Upstreams,
        clients: ClientConnections,
        settings: ProxySettings,
        kv: KvRouting | None = None,
    ) -> None:
        self.upstreams = upstreams
        self.clients = clients
        self.settings = settings
        self.in_progress = 0
        self.closing = False
        self.metrics = ProxyMetrics(upstreams, clients, lambda: self.in_progress)
        self.forward = Forwarder(upstreams, self.metrics, settings, kv)

    async def lifetime(self, app: web.Application) -> AsyncIterator[None]:
        await self.upstreams.start()
        try:
            yield
        finally:
            self.clients.close()
            await self.upstreams.close()

    async def shutting_down(self, app: web.Application) -> None:
        self.closing = True

    @web.middleware
    async def observe(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """Count every request by route and status; end a request whose client left."""
        route = _route(request)
        status = 500
        _REQUEST_ID.set(uuid.uuid4().hex)
        self.clients.started(request.transport, body=request.body_exists)
        self.in_progress += 1
        try:
            response = await handler(request)
            status = response.status
            return response
        except ClientGone as gone:
            status = CLIENT_GONE
            self._gone(request)
            return gone.response or web.Response(status=CLIENT_GONE)
        except asyncio.CancelledError:
            status = 503 if self.closing else CLIENT_GONE
            if not self.closing:
                self._gone(request)
            raise
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            self.in_progress -= 1
            self.metrics.request(route, status)
            self.clients.ended(request.transport)

    def _gone(self, request: web.Request) -> None:
        self.metrics.client_disconnect()
        rid = _REQUEST_ID.get()
        _log.debug("client went away: %s %s (request %s)", request.method, request.path, rid)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        raw = await self._read(request)
        if isinstance(raw, web.StreamResponse):
            return raw
        self.clients.answering(request.transport)
        parsed = await _json_object(raw)
        if isinstance(parsed, web.StreamResponse):
            return parsed
        if not self.upstreams.decode.healthy():
            return self._unavailable()
        body = {k: v for k, v in parsed.items() if k not in PROXY_FIELDS}
        headers = _upstream_headers(request)
        size = len(raw)
        params = await self.forward.prefill(request.path, body, headers, size)
        if params is not None:
            body["kv_transfer_params"] = params
        data = await to_json(body, size)
        return await self.forward.decode(request, request.path, data, headers)

    async def _read(self, request: web.Request) -> bytes | web.StreamResponse:
        """The request's body, or a 413 when it is longer than the limit."""
        limit = self.settings.max_body
        if request.content_length is not None and request.content_length > limit:
            return _too_large(limit)
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _too_large(limit)
        except ConnectionError:
            raise ClientGone(None) from None

    def _unavailable(self) -> web.Response:
        response = error_response(503, "no healthy decode instance", "service_unavailable")
        retry = max(1, round(self.settings.health_interval))
        response.headers[hdrs.RETRY_AFTER] = str(retry)
        return response

    async def models(self, request: web.Request) -> web.StreamResponse:
        if not self.upstreams.decode.healthy():
            return self._unavailable()
        return await self.forward.models(_upstream_headers(request))

    async def health(self, request: web.Request) -> web.StreamResponse:
        roles = {
            pool.role: {"healthy": len(pool.healthy()), "total": len(pool.instances)}
            for pool in (self.upstreams.prefill, self.upstreams.decode)
        }
        if not roles["decode"]["healthy"]:
            return web.json_response({"status": "unavailable", **roles}, status=503)
        whole = all(role["healthy"] == role["total"] for role in roles.values())
        return web.json_response({"status": "ok" if whole else "degraded", **roles})

    async def metrics_text(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=self.metrics.text(), headers={hdrs.CONTENT_TYPE: CONTENT_TYPE})


async def _json_object(raw: bytes) -> dict[str, Any] | web.StreamResponse:
    """The body's JSON object, or a 400."""
    try:
        body = await from_json(raw)
    except (ValueError, RecursionError):
        return error_response(400, "the body is not JSON", "invalid_request_error")
    if not isinstance(body, dict):
        return error_response(400, "the body is not a JSON object", "invalid_request_error")
    return body


def _too_large(limit: int) -> web.Response:
    response = error_response(
        413,
        f"the body is more than {limit} bytes (kvbridge proxy --max-body-size)",
        "request_too_large",
    )
    response.force_close()  # the rest of the body is not read
    return response


def _route(request: web.Request) -> str:
    """The route's path as a metric label (one label for every unknown path)."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


async def _tag(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """Name the request in its answer: ``X-Request-Id`` is the client's when it sent one
    (else the proxy's), ``X-Kvbridge-Request-Id`` the proxy's (the one its log and the
    instances know)."""
    own = _REQUEST_ID.get(None)  # set by ``observe``, in the task that prepares the answer
    if own is not None:
        response.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or own
        response.headers["X-Kvbridge-Request-Id"] = own


def _upstream_headers(request: web.Request) -> dict[str, str]:
    """What an instance is sent besides the body: the proxy's id for the request (never
    the client's), the client's credentials (vLLM's ``--api-key``), the content type."""
    headers = {
        "X-Request-Id": _REQUEST_ID.get(),
        hdrs.CONTENT_TYPE: "application/json",
    }
    if hdrs.AUTHORIZATION in request.headers:
        headers[hdrs.AUTHORIZATION] = request.headers[hdrs.AUTHORIZATION]
    return headers


class ProxyServer:
    """Serves a proxy app on ``host:port`` (port 0: a free one; ``url`` says which) the way
    ``kvbridge proxy`` does: a client that goes away cancels its handler, and so the
    upstream requests it made (aiohttp's ``run_app`` default would leave them running);
    every client connection is in the app's ``ClientConnections``."""

    def __init__(
        self,
        app: web.Application,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        shutdown_grace: float = SHUTDOWN_GRACE_S,
    ) -> None:
        self._runner = web.AppRunner(
            app, handler_cancellation=True, shutdown_timeout=shutdown_grace
        )
        self._host = host
        self._port = port
        self.url = ""

    async def start(self) -> str:
        """Take the port (``OSError`` when it is not free: before anything else), start
        the app (its first health checks included), serve; the URL."""
        sock = _listen(self._host, self._port)
        try:
            await self._runner.setup()
            clients = self._runner.app[CLIENTS]
            site = GuardedSite(
                self._runner,
                sock,
                clients,
                accepts_per_turn=ACCEPTS_PER_TURN,
                backlog=LISTEN_BACKLOG,
            )
            await site.start()
        except BaseException:
            sock.close()
            await self._runner.cleanup()
            raise
        host, port = sock.getsockname()[:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        return self.url

    async def close(self) -> None:
        await self._runner.cleanup()

    async def __aenter__(self) -> ProxyServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)


async def serve(app: web.Application, host: str, port: int, announce: Callable[[str], Any]) -> None:
    """Run ``app`` until SIGINT or SIGTERM; ``announce`` gets the URL once it listens."""
    import signal  # noqa: PLC0415

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with ProxyServer(app, host, port) as server:
        announce(server.url)
        _log.info("client connections at most: %d", app[CLIENTS].cap)
        await stop.wait()
