"""``kvbridge proxy`` under the faults a hostile review found, acted out against the proxy
process an operator runs (``python -m kvbridge proxy``) in front of vLLM-like upstreams on
real sockets: clients that leave mid-answer, upstreams that stall, long decode streams that
filled a shared connection pool, bodies over 1 MiB, prefills that answer something odd."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp", reason="kvbridge proxy needs aiohttp (the proxy extra)")
from aiohttp import ClientSession, TCPConnector
from proxy_support import (
    FakeVllm,
    ProxyProcess,
    completion,
    post,
    scrape,
    settled,
    until,
    until_async,
    whole_stream,
)


@asynccontextmanager
async def _front(tmp_path: Path, *flags: str) -> AsyncIterator[tuple[FakeVllm, FakeVllm, str]]:
    """A prefill and a decode fake, and the proxy process in front of them."""
    prefill, decode = FakeVllm("prefill"), FakeVllm("decode")
    await prefill.start()
    await decode.start()
    proxy = ProxyProcess([prefill.url], [decode.url], tmp_path / "proxy.log", *flags)
    try:
        await proxy.start()
        yield prefill, decode, proxy.url
    finally:
        await prefill.stop()
        await decode.stop()
        assert await proxy.stop() == 0, proxy.log()


async def _first_event(url: str, body: dict[str, Any]) -> None:
    """A client that reads its answer's first bytes, then waits (to be cancelled: it
    leaves, closing its connection)."""
    async with ClientSession() as session, session.post(url, json=body) as answer:
        await answer.content.readany()
        await asyncio.Event().wait()


async def _leave(clients: list[asyncio.Task[Any]]) -> None:
    for client in clients:
        client.cancel()
    await asyncio.gather(*clients, return_exceptions=True)


# -- a client that leaves frees its upstream request and connection ------------------------


@pytest.mark.slow
def test_clients_that_leave_end_their_upstream_requests(tmp_path: Path) -> None:
    """Three rounds of 40 clients leave while decode is silent (no status yet) or holds its
    stream; after each round the decode instance has nothing in progress (the proxy closed
    every upstream request), and after all 120 (the old pool held 100) a fresh request is
    served."""
    asyncio.run(_clients_that_leave(tmp_path))


async def _clients_that_leave(tmp_path: Path) -> None:
    async with _front(tmp_path) as (_, decode, url):
        target = f"{url}/v1/completions"
        for round_ in range(3):
            bodies = [completion(decode="stall" if i % 2 else "hold") for i in range(40)]
            clients = [asyncio.create_task(_first_event(target, body)) for body in bodies]
            await until(lambda: decode.in_progress == 40, f"round {round_}: 40 at decode")
            await _leave(clients)
            await until(lambda: decode.in_progress == 0, f"round {round_}: decode freed")
        async with ClientSession() as session:
            status, data = await post(session, target, completion())
        assert status == 200 and whole_stream(data)


# -- prefill and decode do not starve each other --------------------------------------------


@pytest.mark.slow
def test_long_decode_streams_do_not_hold_up_new_requests(tmp_path: Path) -> None:
    """130 streams at once, each held by decode after its first event: every one gets that
    first event (its prefill and decode ran beside the others), then each ends whole."""
    asyncio.run(_long_streams(tmp_path))


async def _long_streams(tmp_path: Path) -> None:
    count = 130
    async with (
        _front(tmp_path) as (prefill, decode, url),
        ClientSession(connector=TCPConnector(limit=0)) as session,
    ):
        firsts: list[bytes] = []

        async def stream() -> bytes:
            async with session.post(f"{url}/v1/completions", json=completion("hold")) as answer:
                first = await answer.content.readany()
                firsts.append(first)
                return first + await answer.read()

        streams = [asyncio.create_task(stream()) for _ in range(count)]
        await until(lambda: len(firsts) == count, f"{count} first events", timeout=30)
        assert len(prefill.bodies) == count
        decode.release()
        assert all(whole_stream(data) for data in await settled(streams, "the streams end"))


# -- bodies over 1 MiB ------------------------------------------------------------------------


@pytest.mark.slow
def test_bodies_over_one_mib_reach_the_instances(tmp_path: Path) -> None:
    """A 2 MiB image chat request and a 1.5 MiB token-id prompt (vLLM takes both) pass."""
    asyncio.run(_large_bodies(tmp_path))


async def _large_bodies(tmp_path: Path) -> None:
    image = base64.b64encode(bytes(range(256)) * (6 << 10)).decode()  # 2 MiB of base64
    chat = completion(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
                    {"type": "text", "text": "what is this?"},
                ],
            }
        ]
    )
    tokens = completion(prompt=list(range(100_000, 350_000)))
    assert len(json.dumps(chat)) > 2 << 20 and len(json.dumps(tokens)) > 1.5 * (1 << 20)
    async with _front(tmp_path) as (prefill, decode, url), ClientSession() as session:
        status, data = await post(session, f"{url}/v1/chat/completions", chat)
        assert status == 200 and whole_stream(data), data[:200]
        status, data = await post(session, f"{url}/v1/completions", tokens)
        assert status == 200 and whole_stream(data), data[:200]
    assert [b["prompt"] == tokens["prompt"] for b in decode.bodies] == [False, True]
    assert decode.bodies[0]["messages"] == chat["messages"]
    assert prefill.bodies[1]["prompt"] == tokens["prompt"]


def test_a_body_over_the_limit_is_a_json_413(tmp_path: Path) -> None:
    """With ``--max-body-size 1MiB``, a 2 MiB body (with a length, or chunked with none)
    is a 413 whose JSON says why; no instance sees it."""
    asyncio.run(_over_the_limit(tmp_path))


async def _over_the_limit(tmp_path: Path) -> None:
    body = json.dumps(completion(prompt="x" * (2 << 20))).encode()

    async def chunked() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 1 << 16):
            yield body[start : start + (1 << 16)]

    async with (
        _front(tmp_path, "--max-body-size", "1MiB") as (prefill, decode, url),
        ClientSession() as session,
    ):
        for data in (body, chunked()):
            async with session.post(f"{url}/v1/completions", data=data) as answer:
                assert answer.status == 413
                error = (await answer.json())["error"]
            assert "more than 1048576 bytes" in error["message"] and error["code"] == 413
        status, data = await post(session, f"{url}/v1/completions", completion())
        assert status == 200 and whole_stream(data)
    assert len(prefill.bodies) == len(decode.bodies) == 1


# -- every odd prefill answer falls back to decode -------------------------------------------

ODD_PREFILLS = {
    "list": "answer",
    "string": "answer",
    "number": "answer",
    "null": "answer",
    "notjson": "answer",
    "html": "answer",
    "truncated": "answer",
    "noparams": "no_params",
    "params_list": "no_params",
    "500": "status",
    "drop": "dropped",
    "cut": "failed",
}


@pytest.mark.slow
def test_an_odd_prefill_answer_falls_back_to_decode(tmp_path: Path) -> None:
    """A prefill that answers 200 with a list (or anything that is not a JSON object with
    ``kv_transfer_params``), errs, or drops the connection: decode computes the prompt, the
    client gets the whole answer, and the fallback is counted by reason."""
    asyncio.run(_odd_prefills(tmp_path))


async def _odd_prefills(tmp_path: Path) -> None:
    async with _front(tmp_path) as (prefill, decode, url), ClientSession() as session:
        for mode in ODD_PREFILLS:
            status, data = await post(session, f"{url}/v1/completions", completion(prefill=mode))
            assert (status, whole_stream(data)) == (200, True), (mode, status, data)
            assert "kv_transfer_params" not in decode.bodies[-1], mode
        metrics = await scrape(url)
    for reason in set(ODD_PREFILLS.values()):
        got = metrics.value("kvbridge_proxy_prefill_fallbacks_total", reason=reason)
        assert got == list(ODD_PREFILLS.values()).count(reason), reason
    assert len(prefill.bodies) == len(ODD_PREFILLS) + 1  # the drop, tried again
    assert decode.in_progress == 0


# -- a client that leaves is one quiet line, counted ------------------------------------------


@pytest.mark.slow
def test_a_client_that_leaves_is_counted_without_an_error_log(tmp_path: Path) -> None:
    """Five clients leave streams that are still flowing: the proxy counts five client
    disconnects, ends the five upstream requests, and logs no error or traceback."""
    asyncio.run(_quiet_disconnects(tmp_path))


async def _quiet_disconnects(tmp_path: Path) -> None:
    log = tmp_path / "proxy.log"
    async with _front(tmp_path) as (_, decode, url):
        target = f"{url}/v1/completions"
        clients = [
            asyncio.create_task(_first_event(target, completion("trickle"))) for _ in "12345"
        ]
        await until(lambda: decode.in_progress == 5, "five streams flowing")
        await _leave(clients)
        await until(lambda: decode.in_progress == 0, "the five upstream requests ended")

        async def counted() -> bool:
            metrics = await scrape(url)
            return metrics.value("kvbridge_proxy_client_disconnects_total") == 5

        await until_async(counted, "five client disconnects counted")
        metrics = await scrape(url)
        assert metrics.value("kvbridge_proxy_requests_total", status="499") == 5
    text = log.read_text()
    assert "Traceback" not in text and " ERROR " not in text, text
