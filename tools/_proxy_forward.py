"""One completion's two hops: the prefill (one token, for the ``kv_transfer_params`` of its
answer) and the decode (its answer streamed back as it comes).

What may fail, and what the client sees:

- the prefill: any failure (no healthy instance, refused, timed out, a status other than
  200, an answer that is not a JSON object with ``kv_transfer_params``) costs time only:
  decode computes the prompt itself (a *fallback*, counted by reason);
- the decode, before its status: tried once more, on another healthy instance when there is
  one (nothing reached the client, so a second try cannot duplicate anything); then 502;
  503 at once when no decode instance is healthy;
- the decode, after its status: never tried again; when its answer breaks off, the client's
  connection is closed without the end of the answer, so a cut stream never reads as a
  whole one;
- the client, going away: ``ClientGone`` (or a cancelled handler) ends the request, and
  leaving the ``async with`` of an unfinished upstream answer closes its connection, so the
  instance stops generating for nobody.

A connection refused takes an instance out of the rotation at once (the health checker
brings it back); the upstream's connection pools and the health checker are ``Upstreams``'.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from aiohttp import (
    ClientConnectionError,
    ClientConnectorError,
    ClientError,
    ClientResponse,
    ClientTimeout,
    StreamReader,
    hdrs,
    web,
)

from ._fail import one_line
from ._proxy_metrics import ProxyMetrics
from ._proxy_settings import ATTEMPTS, PREFILL_ANSWER_MAX, ProxySettings, kv_score
from ._proxy_upstreams import Instance, Pool, Upstreams

if TYPE_CHECKING:
    from ._proxy_kv import KvRouting

_log = logging.getLogger("kvbridge.proxy")

DROP_FOR_PREFILL = (
    "stream_options",
    "min_tokens",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "n",
    "best_of",
)
"""Request fields a one-token prefill must not carry (its answer is dropped but for the
``kv_transfer_params``; these only cost it work, or make it answer in pieces)."""

JSON_IN_THREAD_OVER = 1 << 20
"""Bodies larger than this are parsed and written as JSON off the event loop: 1 MiB takes
a few milliseconds, 64 MiB about a second, which would stall every stream in flight."""


class ClientGone(Exception):
    """The client went away while the proxy answered it: the request ends here."""

    def __init__(self, response: web.StreamResponse | None) -> None:
        super().__init__("the client went away")
        self.response = response


class NoAnswer(Exception):
    """No instance of a role answered with a status: none healthy, or every try failed."""

    def __init__(self, role: str, reason: str, why: str) -> None:
        super().__init__(f"{role}: {why}")
        self.role = role
        self.reason = reason
        self.why = why

    def response(self) -> web.Response:
        """What the client is told: 503 when no instance was healthy, else 502."""
        status = 503 if self.reason == "unavailable" else 502
        return error_response(status, f"{self.role}: {self.why}", "upstream_error")


async def from_json(raw: bytes) -> Any:
    """``raw`` parsed (``ValueError`` or ``RecursionError`` when it is not JSON)."""
    if len(raw) > JSON_IN_THREAD_OVER:
        return await asyncio.to_thread(json.loads, raw)
    return json.loads(raw)


async def to_json(value: Any, size_hint: int) -> bytes:
    if size_hint > JSON_IN_THREAD_OVER:
        return await asyncio.to_thread(_dumps, value)
    return _dumps(value)


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What the prefill is sent: the request for one token, not streamed."""
    first = {k: v for k, v in body.items() if k not in DROP_FOR_PREFILL}
    first.update(max_tokens=1, stream=False)
    if "max_completion_tokens" in first:
        first["max_completion_tokens"] = 1
    return first


def error_response(status: int, message: str, kind: str) -> web.Response:
    """An OpenAI-style JSON error."""
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status=status,
    )


class Forwarder:
    """Sends a completion's prefill and decode to the instances ``Upstreams`` picks."""

    def __init__(
        self,
        upstreams: Upstreams,
        metrics: ProxyMetrics,
        settings: ProxySettings,
        kv: KvRouting | None = None,
    ) -> None:
        """``kv``: prefill instances chosen by their caches (``--route kv``), else by load."""
        self._upstreams = upstreams
        self._metrics = metrics
        self._kv = kv
        self._prefill_timeout = ClientTimeout(total=settings.prefill_timeout)
        self._control = ClientTimeout(total=settings.health_timeout)

    async def prefill(
        self, path: str, body: dict[str, Any], headers: Mapping[str, str], size_hint: int
    ) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` of a prefill's answer, or ``None`` (counted, logged):
        decode then computes the prompt itself."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            data = await to_json(prefill_body(body), size_hint)
            params, reason, why = await self._prefill(path, data, headers, self._scores(body))
        finally:
            self._metrics.prefill_time(loop.time() - started)
        if params is None:
            self._metrics.fallback(reason)
            log = _log.debug if reason == "unavailable" else _log.warning
            log("prefill %s; decode computes the prompt (request %s)", why, _rid(headers))
        return params

    async def decode(
        self, request: web.Request, path: str, data: bytes, headers: Mapping[str, str]
    ) -> web.StreamResponse:
        """The decode's answer, streamed to the client as it comes."""
        exchange = self._answer(self._upstreams.decode, "POST", path, data, headers)
        try:
            async with exchange as (instance, answer):
                return await self._relay(request, instance, answer, _rid(headers))
        except NoAnswer as exc:
            response = exc.response()
            log = _log.debug if exc.reason == "unavailable" else _log.warning
            log("decode %s; answered %d (request %s)", exc.why, response.status, _rid(headers))
            return response

    async def models(self, headers: Mapping[str, str]) -> web.Response:
        """``/v1/models`` of a healthy decode instance, passed through."""
        pool = self._upstreams.decode
        exchange = self._answer(pool, "GET", "/v1/models", None, headers, timeout=self._control)
        try:
            async with exchange as (_, answer):
                body = await answer.read()
                content_type = answer.headers.get(hdrs.CONTENT_TYPE, "application/json")
                return web.Response(
                    body=body, status=answer.status, headers={hdrs.CONTENT_TYPE: content_type}
                )
        except NoAnswer as exc:
            return exc.response()
        except (ClientError, asyncio.TimeoutError) as exc:
            return error_response(502, f"decode: {_describe(exc)}", "upstream_error")

    def _scores(self, body: Mapping[str, Any]) -> dict[str, int] | None:
        """``--route kv``: per prefill instance, the prompt's tokens it holds or can load."""
        if self._kv is None:
            return None
        scores = self._kv.scores(body)
        if scores is None:
            self._metrics.kv_unrouted()
        return scores

    async def _prefill(
        self,
        path: str,
        data: bytes,
        headers: Mapping[str, str],
        scores: Mapping[str, int] | None = None,
    ) -> tuple[dict[str, Any] | None, str, str]:
        """``(params, "", "")``, or ``(None, reason, why)``."""
        pool = self._upstreams.prefill
        exchange = self._answer(
            pool, "POST", path, data, headers, timeout=self._prefill_timeout, scores=scores
        )
        try:
            async with exchange as (instance, answer):
                if scores is not None:
                    held = kv_score(scores, instance.url)
                    self._metrics.kv_routed(held, best=held == max(scores.values()))
                return await self._params(instance, answer)
        except NoAnswer as exc:
            return None, exc.reason, exc.why
        except asyncio.TimeoutError:
            return None, "timeout", "timed out"
        except ClientError as exc:
            return None, "failed", _describe(exc)

    async def _params(
        self, instance: Instance, answer: ClientResponse
    ) -> tuple[dict[str, Any] | None, str, str]:
        where = f"{instance.url} answered"
        if answer.status != 200:
            if answer.status >= 500:
                self._error(instance, "status")
            return None, "status", f"{where} {answer.status}"
        raw = await _read_at_most(answer.content, PREFILL_ANSWER_MAX)
        if raw is None:
            return None, "answer", f"{where} more than {PREFILL_ANSWER_MAX} bytes"
        try:
            parsed = await from_json(raw)
        except (ValueError, RecursionError):
            return None, "answer", f"{where} something that is not JSON"
        if not isinstance(parsed, dict):
            return None, "answer", f"{where} JSON that is not an object"
        self._count_usage(instance, parsed.get("usage"))
        params = parsed.get("kv_transfer_params")
        if not isinstance(params, dict):
            return None, "no_params", f"{where} no kv_transfer_params object"
        return params, "", ""

    def _count_usage(self, instance: Instance, usage: Any) -> None:
        """The prefill's prompt tokens, and how many it did not compute (where it says)."""
        if not isinstance(usage, dict) or not _count(usage.get("prompt_tokens")):
            return
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        prompt = usage["prompt_tokens"]
        reported = cached if _count(cached) and cached <= prompt else None
        self._metrics.prefill_tokens(instance.url, prompt, reported)

    @asynccontextmanager
    async def _answer(
        self,
        pool: Pool,
        method: str,
        path: str,
        data: bytes | None,
        headers: Mapping[str, str],
        *,
        timeout: ClientTimeout | None = None,
        scores: Mapping[str, int] | None = None,
    ) -> AsyncIterator[tuple[Instance, ClientResponse]]:
        """The first answer (its status and headers) of a healthy instance of ``pool``,
        held open (and the instance's request outstanding) for the block; ``NoAnswer`` when
        none came. A try that got no status is tried once more."""
        tried: list[Instance] = []
        reason, why = "unavailable", "no healthy instance"
        for attempt in range(1, ATTEMPTS + 1):
            instance = pool.pick(tried, scores) or pool.pick(scores=scores)
            if instance is None:
                break
            tried.append(instance)
            with instance.lease():
                try:
                    answer = await instance.session.request(
                        method,
                        instance.url + path,
                        data=data,
                        headers=headers,
                        timeout=timeout or instance.session.timeout,
                    )
                except (ClientError, asyncio.TimeoutError) as exc:
                    reason, why = self._failed(instance, exc)
                    if reason not in ("refused", "dropped"):
                        break
                    if attempt < ATTEMPTS:
                        _log.warning("%s %s; trying again", pool.role, why)
                    continue
                async with answer:
                    yield instance, answer
                    return
        raise NoAnswer(pool.role, reason, why)

    def _failed(self, instance: Instance, exc: BaseException) -> tuple[str, str]:
        """Count a try that got no status; ``(kind, why)``. A refused connection takes the
        instance out of the rotation."""
        if isinstance(exc, ClientConnectorError):
            kind = "refused"
            self._upstreams.suspect(instance, _describe(exc))
        elif isinstance(exc, asyncio.TimeoutError):
            kind = "timeout"
        elif isinstance(exc, ClientConnectionError):
            kind = "dropped"
        else:
            kind = "failed"
        self._error(instance, kind)
        return kind, f"{instance.url}: {_describe(exc)}"

    def _error(self, instance: Instance, kind: str) -> None:
        self._metrics.upstream_error(instance.role, instance.url, kind)

    async def _relay(
        self, request: web.Request, instance: Instance, answer: ClientResponse, rid: str
    ) -> web.StreamResponse:
        if answer.status >= 500:
            self._error(instance, "status")
        response = web.StreamResponse(status=answer.status, reason=answer.reason)
        content_type = answer.headers.get(hdrs.CONTENT_TYPE)
        if content_type:
            response.headers[hdrs.CONTENT_TYPE] = content_type
        await _to_client(response, response.prepare(request))
        while True:
            try:
                chunk = await answer.content.readany()
            except (ClientError, asyncio.TimeoutError) as exc:
                self._cut(request, instance, exc, rid)
                return response
            if not chunk:
                break
            await _to_client(response, response.write(chunk))
        await _to_client(response, response.write_eof())
        return response

    def _cut(self, request: web.Request, instance: Instance, exc: BaseException, rid: str) -> None:
        """The decode's answer broke off: close the client's connection before the end of
        the answer (the client sees an incomplete answer, never a short whole one)."""
        self._error(instance, "cut")
        _log.warning("decode %s broke off (%s): request %s cut", instance.url, _describe(exc), rid)
        if request.transport is not None:
            request.transport.close()


async def _to_client(response: web.StreamResponse, sending: Awaitable[object]) -> None:
    """Await a write to the client; ``ClientGone`` when it is no longer there."""
    try:
        await sending
    except ConnectionError:
        raise ClientGone(response) from None


async def _read_at_most(content: StreamReader, limit: int) -> bytes | None:
    """The whole body, or ``None`` when it is longer than ``limit`` bytes."""
    parts: list[bytes] = []
    size = 0
    while chunk := await content.readany():
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError) and not str(exc):
        return "timed out"
    return one_line(str(exc) or type(exc).__name__)


def _rid(headers: Mapping[str, str]) -> str:
    return headers.get("X-Request-Id", "")


def _count(value: Any) -> bool:
    """A token count an upstream reported: an int, not a bool, not negative."""
    return type(value) is int and value >= 0
