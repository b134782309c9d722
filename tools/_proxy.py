"""``kvbridge proxy``: an OpenAI-compatible front for prefill/decode disaggregation.

Each completion (``/v1/completions``, ``/v1/chat/completions``) goes first to a prefill
instance with ``max_tokens=1`` (it computes the prompt, and its kvbridge connector saves the
prompt's blocks), then to a decode instance with the ``kv_transfer_params`` the prefill's
answer carried (its connector waits for those blocks and loads them); the decode's answer
streams back as it comes. A prefill that fails costs time only: the request goes to decode
without parameters, and decode computes the prompt itself. HTTP: aiohttp (client and
server, streaming), the ``proxy`` extra.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import uuid
from collections.abc import Sequence
from typing import Any

_log = logging.getLogger("kvbridge.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
_DROP_FOR_PREFILL = ("stream_options", "min_tokens", "logprobs", "top_logprobs", "n", "best_of")


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "proxy",
        help="OpenAI-compatible front: prefill on one vLLM, decode on another",
        description="Send each completion to a prefill instance (max_tokens=1), then to a "
        "decode instance with the prefill's kv_transfer_params; stream the decode's answer.",
    )
    parser.add_argument(
        "--prefill",
        action="append",
        required=True,
        metavar="URL",
        help="a prefill instance (repeat for several: round robin)",
    )
    parser.add_argument(
        "--decode",
        action="append",
        required=True,
        metavar="URL",
        help="a decode instance (repeat for several: round robin)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--prefill-timeout", type=float, default=600.0, metavar="SECONDS")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        from aiohttp import web  # noqa: PLC0415  (the optional extra)
    except ImportError:
        from ._fail import fail  # noqa: PLC0415

        return fail("kvbridge proxy", "needs aiohttp: pip install 'kvbridge[proxy]'")
    if not 0 <= args.port < 65536 or args.prefill_timeout <= 0:
        from ._fail import fail  # noqa: PLC0415

        return fail("kvbridge proxy", "--port must be 0..65535 and --prefill-timeout positive")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    app = make_app(args.prefill, args.decode, prefill_timeout=args.prefill_timeout)
    print(f"kvbridge proxy listening on http://{args.host}:{args.port}", flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None)
    return 0


def make_app(
    prefill: Sequence[str], decode: Sequence[str], *, prefill_timeout: float = 600.0
) -> Any:
    """The proxy as an aiohttp application (the tests run it in-process)."""
    from aiohttp import ClientSession, ClientTimeout, web  # noqa: PLC0415

    session_key = web.AppKey("session", ClientSession)
    prefills = itertools.cycle([url.rstrip("/") for url in prefill])
    decodes = itertools.cycle([url.rstrip("/") for url in decode])

    async def session_ctx(app: Any) -> Any:
        app[session_key] = ClientSession(timeout=ClientTimeout(total=None, sock_connect=10))
        yield
        await app[session_key].close()

    async def completions(request: Any) -> Any:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": {"message": "the body is not JSON"}}, status=400)
        if not isinstance(body, dict):
            return web.json_response(
                {"error": {"message": "the body is not an object"}}, status=400
            )
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        session = request.app[session_key]
        params = await _prefill(session, next(prefills) + request.path, body, rid, prefill_timeout)
        if params:
            body = {**body, "kv_transfer_params": params}
        return await _decode(request, session, next(decodes) + request.path, body, rid)

    async def models(request: Any) -> Any:
        async with request.app[session_key].get(next(decodes) + request.path) as upstream:
            return web.Response(
                body=await upstream.read(), status=upstream.status, content_type="application/json"
            )

    async def health(request: Any) -> Any:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.cleanup_ctx.append(session_ctx)
    for route in ROUTES:
        app.router.add_post(route, completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    return app


async def _prefill(
    session: Any, url: str, body: dict[str, Any], rid: str, timeout: float
) -> dict[str, Any] | None:
    """Run the prompt on a prefill instance; the ``kv_transfer_params`` of its answer, or
    ``None`` (logged) when it failed: decode then computes the prompt itself."""
    from aiohttp import ClientError, ClientTimeout  # noqa: PLC0415

    first = {k: v for k, v in body.items() if k not in _DROP_FOR_PREFILL}
    first.update(max_tokens=1, stream=False)
    if "max_completion_tokens" in first:
        first["max_completion_tokens"] = 1
    try:
        async with session.post(
            url, json=first, headers={"X-Request-Id": rid}, timeout=ClientTimeout(total=timeout)
        ) as answer:
            if answer.status != 200:
                _log.warning(
                    "prefill %s answered %d: decode computes the prompt", url, answer.status
                )
                return None
            params = (await answer.json()).get("kv_transfer_params")
    except (ClientError, TimeoutError, ValueError) as exc:
        _log.warning("prefill %s failed (%s): decode computes the prompt", url, exc)
        return None
    return params if isinstance(params, dict) else None


async def _decode(request: Any, session: Any, url: str, body: dict[str, Any], rid: str) -> Any:
    """Forward to a decode instance and stream its answer back as it comes."""
    from aiohttp import ClientError, web  # noqa: PLC0415

    try:
        upstream = await session.post(url, json=body, headers={"X-Request-Id": rid})
    except ClientError as exc:
        return web.json_response({"error": {"message": f"decode {url}: {exc}"}}, status=502)
    async with upstream:
        response = web.StreamResponse(status=upstream.status)
        response.content_type = upstream.content_type
        response.headers["X-Request-Id"] = rid
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response
