"""``kvbridge proxy`` against fake prefill and decode instances (the real two-vLLM run is
in tests/with_vllm): what each side is sent, what the client gets, a failed prefill, and
the command line's one-line errors. Faults: test_proxy_faults.py; several instances per
role, health and metrics: test_proxy_routing.py; the soak: test_proxy_soak.py."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from typing import Any

import pytest

web = pytest.importorskip("aiohttp.web", reason="kvbridge proxy needs aiohttp (the proxy extra)")
from aiohttp import ClientSession  # noqa: E402
from aiohttp.test_utils import TestClient, TestServer  # noqa: E402
from proxy_support import Deployment, completion, whole_stream  # noqa: E402

from kvbridge.tools import cli  # noqa: E402
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


@pytest.mark.parametrize(
    "body", [b"[" * 100_000 + b"]" * 100_000, b"[1, 2]", b'"prompt"'], ids=["deep", "list", "str"]
)
def test_a_body_that_is_not_a_json_object_is_a_400_and_reaches_nobody(body: bytes) -> None:
    up = _Upstreams()
    status, data = asyncio.run(_through_proxy(up, "/v1/completions", body))
    assert status == 400 and json.loads(data)["error"]["code"] == 400
    assert not up.prefill_bodies and not up.decode_bodies


def test_credentials_pass_through_the_request_id_is_the_proxys_and_prefill_skips_extras() -> None:
    """Authorization (vLLM's --api-key) reaches both instances; both see the proxy's own
    request id (one, the same at both), and the client's comes back in the answer only
    (test_proxy_hostile.py tries to get one through); a one-token prefill is not asked for
    logprobs or n."""

    async def scenario() -> None:
        async with Deployment() as d, ClientSession() as session:
            body = completion(logprobs=2, prompt_logprobs=1, n=1, min_tokens=4)
            headers = {"X-Request-Id": "req-17", "Authorization": "Bearer k"}
            async with session.post(
                f"{d.url}/v1/completions", json=body, headers=headers
            ) as answer:
                assert answer.status == 200 and answer.headers["X-Request-Id"] == "req-17"
                own = answer.headers["X-Kvbridge-Request-Id"]
                assert whole_stream(await answer.read())
            (prefill,), (decode,) = d.prefills, d.decodes
            assert prefill.request_ids == decode.request_ids == [own]
            assert prefill.authorizations == decode.authorizations == ["Bearer k"]
            first, second = prefill.bodies[0], decode.bodies[0]
            assert not {"logprobs", "prompt_logprobs", "n", "min_tokens"} & first.keys()
            assert second["logprobs"] == 2 and second["min_tokens"] == 4
            assert second["kv_transfer_params"] == {"prefill": prefill.port, "rid": own}

    asyncio.run(scenario())


BASE_FLAGS = ["proxy", "--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8200"]
BAD_FLAGS = {
    "no scheme": (["--prefill", "127.0.0.1:8101"], "give http://host:port"),
    "not http": (["--decode", "ftp://127.0.0.1:8201"], "give http://host:port"),
    "port out of range": (["--decode", "http://127.0.0.1:99999"], "out of range"),
    "no host": (["--decode", "http://:8201"], "no host"),
    "a query": (["--prefill", "http://h:1/?x=1"], "no query"),
    "given twice": (["--decode", "http://127.0.0.1:8200/"], "given twice"),
    "listen port": (["--port", "70000"], "--port must be 0..65535"),
    "body size": (["--max-body-size", "lots"], "--max-body-size"),
    "connections": (["--connections-per-instance", "0"], "--connections-per-instance"),
    "health timeout": (["--health-timeout", "-1"], "--health-timeout"),
    "prefill timeout": (["--prefill-timeout", "nan"], "--prefill-timeout"),
    "head timeout": (["--head-timeout", "0"], "--head-timeout"),
    "idle timeout": (["--idle-timeout", "inf"], "--idle-timeout"),
    "client connections": (["--max-client-connections", "-3"], "--max-client-connections"),
}


@pytest.mark.parametrize("flags", BAD_FLAGS.values(), ids=BAD_FLAGS.keys())
def test_bad_flags_are_one_line_errors(
    flags: tuple[list[str], str], capsys: pytest.CaptureFixture[str]
) -> None:
    extra, says = flags
    assert cli.main([*BASE_FLAGS, *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvbridge proxy: ") and says in err, err


@pytest.mark.slow
def test_port_0_takes_a_free_port_and_prints_it_and_sigterm_stops_cleanly() -> None:
    async def scenario() -> None:
        async with Deployment() as d:  # instances for the proxy process to check
            prefill, decode = d.prefills[0].url, d.decodes[0].url
            proxy = await asyncio.create_subprocess_exec(
                *(sys.executable, "-m", "kvbridge", "proxy", "--port", "0"),
                *("--prefill", prefill, "--decode", decode),
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            assert proxy.stdout is not None
            try:
                line = await asyncio.wait_for(proxy.stdout.readline(), 60)
                url = line.decode().removeprefix("kvbridge proxy listening on ").strip()
                assert url.startswith("http://127.0.0.1:") and not url.endswith(":0"), line
                async with ClientSession() as session, session.get(f"{url}/health") as answer:
                    assert answer.status == 200
            finally:
                proxy.terminate()
                assert await asyncio.wait_for(proxy.wait(), 60) == 0

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_port_in_use_is_a_one_line_error_before_anything_else() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "kvbridge", *BASE_FLAGS, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"kvbridge proxy: cannot listen on 127.0.0.1:{port}: ")
