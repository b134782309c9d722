"""``kvbridge proxy`` against fake prefill and decode instances (the real two-vLLM run is
in tests/with_vllm): what each side is sent, what the client gets, and a failed prefill."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

web = pytest.importorskip("aiohttp.web", reason="kvbridge proxy needs aiohttp (the proxy extra)")
from aiohttp.test_utils import TestClient, TestServer  # noqa: E402

from kvbridge.tools._proxy import make_app  # noqa: E402


class _Upstreams:
    """A prefill and a decode instance that record what they were sent."""

    def __init__(self, prefill_status: int = 200) -> None:
        self.prefill_bodies: list[dict[str, Any]] = []
        self.decode_bodies: list[dict[str, Any]] = []
        self.prefill_status = prefill_status

    def prefill_app(self) -> Any:
        async def handle(request: Any) -> Any:
            self.prefill_bodies.append(await request.json())
            if self.prefill_status != 200:
                return web.json_response({"error": "boom"}, status=self.prefill_status)
            return web.json_response(
                {"choices": [{"text": "x"}], "kv_transfer_params": {"kvbridge_blocks": 3}}
            )

        return _vllm_like(handle)

    def decode_app(self) -> Any:
        async def handle(request: Any) -> Any:
            body = await request.json()
            self.decode_bodies.append(body)
            if not body.get("stream"):
                return web.json_response({"choices": [{"text": "decoded"}]})
            response = web.StreamResponse()
            response.content_type = "text/event-stream"
            await response.prepare(request)
            for part in ("a", "b", "c"):
                await response.write(f"data: {json.dumps({'text': part})}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            return response

        return _vllm_like(handle)


def _vllm_like(handle: Any) -> Any:
    async def health(request: Any) -> Any:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_get("/health", health)  # the proxy's health checks
    return app


async def _through_proxy(upstreams: _Upstreams, path: str, body: Any) -> tuple[int, bytes]:
    async with (
        TestServer(upstreams.prefill_app()) as prefill,
        TestServer(upstreams.decode_app()) as decode,
    ):
        app = make_app([str(prefill.make_url(""))], [str(decode.make_url(""))])
        async with TestClient(TestServer(app)) as client:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = await client.post(
                path, data=data, headers={"Content-Type": "application/json"}
            )
            return response.status, await response.read()


def test_prefill_gets_one_token_and_decode_gets_its_params() -> None:
    up = _Upstreams()
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 50, "stream": True, "n": 1}
    status, data = asyncio.run(_through_proxy(up, "/v1/completions", body))
    assert status == 200
    assert data.count(b"data: ") == 4 and data.endswith(b"data: [DONE]\n\n")  # streamed through
    (first,) = up.prefill_bodies
    assert first["max_tokens"] == 1 and first["stream"] is False and "n" not in first
    (second,) = up.decode_bodies
    assert second["kv_transfer_params"] == {"kvbridge_blocks": 3}
    assert second["max_tokens"] == 50 and second["stream"] is True


def test_chat_completions_limit_max_completion_tokens_too() -> None:
    up = _Upstreams()
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 9,
    }
    status, data = asyncio.run(_through_proxy(up, "/v1/chat/completions", body))
    assert status == 200 and json.loads(data)["choices"][0]["text"] == "decoded"
    assert up.prefill_bodies[0]["max_completion_tokens"] == 1


def test_a_failed_prefill_sends_the_request_to_decode_without_params() -> None:
    up = _Upstreams(prefill_status=500)
    status, _ = asyncio.run(_through_proxy(up, "/v1/completions", {"prompt": "p", "max_tokens": 4}))
    assert status == 200
    assert "kv_transfer_params" not in up.decode_bodies[0]


def test_a_body_that_is_not_json_is_a_400_and_reaches_nobody() -> None:
    up = _Upstreams()
    status, data = asyncio.run(_through_proxy(up, "/v1/completions", b"{not json"))
    assert status == 400 and b"not JSON" in data
    assert not up.prefill_bodies and not up.decode_bodies
