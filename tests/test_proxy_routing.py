"""``kvbridge proxy`` as a front door to several instances per role: least-loaded routing,
health checks taking instances out and back, a decode tried again only before its status,
the connection bound per instance, and ``/v1/models``, ``/health``, ``/metrics``. The proxy
runs in the test's event loop (``ProxyServer``, as ``kvbridge proxy`` serves it), in front
of vLLM-like fakes on real sockets."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytest.importorskip("aiohttp", reason="kvbridge proxy needs aiohttp (the proxy extra)")
from aiohttp import ClientPayloadError, ClientSession
from proxy_support import (
    Deployment,
    FakeVllm,
    completion,
    post,
    settled,
    until,
    until_async,
    whole_stream,
)

from kvbridge.tools._proxy_settings import ProxySettings

QUICK_CHECKS = ProxySettings(health_interval=0.05, health_timeout=0.5)


async def _answered_by(session: ClientSession, deployment: Deployment, count: int) -> list[int]:
    """Send ``count`` requests one after another; which decode (index) answered each."""
    ports = [fake.port for fake in deployment.decodes]
    answered = []
    for _ in range(count):
        status, data = await post(session, f"{deployment.url}/v1/completions", _unstreamed())
        assert status == 200, data
        answered.append(ports.index(json.loads(data)["from"]))
    return answered


def _unstreamed(**fields: Any) -> dict[str, Any]:
    return completion(stream=False, **fields)


async def _healthy(deployment: Deployment, fake: FakeVllm, healthy: bool) -> None:
    async def check() -> bool:
        metrics = await deployment.metrics()
        gauge = metrics.value("kvbridge_proxy_instance_healthy", instance=fake.url)
        return gauge == int(healthy)

    await until_async(check, f"{fake.role} {fake.url} {'in' if healthy else 'out'}")


# -- routing ------------------------------------------------------------------------------


def test_idle_instances_take_requests_in_turn() -> None:
    async def scenario() -> None:
        async with Deployment(prefills=2, decodes=3) as d, ClientSession() as session:
            assert await _answered_by(session, d, 6) == [0, 1, 2, 0, 1, 2]
            assert [len(fake.bodies) for fake in d.prefills] == [3, 3]

    asyncio.run(scenario())


def test_a_request_goes_to_the_least_loaded_decode() -> None:
    """Four held streams spread two and two; once one instance's streams end, the next
    requests all go to it (round robin would send every other one to the busy instance)."""

    async def scenario() -> None:
        async with Deployment(decodes=2) as d, ClientSession() as session:
            first, second = d.decodes
            held = []
            for _ in range(4):
                held.append(asyncio.create_task(_stream(session, d.url, "hold")))
                await until(lambda: first.in_progress + second.in_progress == len(held), "held")
            assert (first.in_progress, second.in_progress) == (2, 2)
            second.release()
            await until(lambda: second.in_progress == 0, "the second's streams ended")
            assert await _answered_by(session, d, 3) == [1, 1, 1]
            first.release()
            assert all(whole_stream(data) for data in await settled(held, "the held streams end"))

    asyncio.run(scenario())


async def _stream(session: ClientSession, url: str, decode: str) -> bytes:
    async with session.post(f"{url}/v1/completions", json=completion(decode)) as answer:
        assert answer.status == 200
        return await answer.read()


# -- health ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_health_checks_take_an_instance_out_and_bring_it_back() -> None:
    """Out while its /health answers 503, hangs past the timeout, or its socket is closed;
    back each time it answers 200 again; no request reaches it while it is out."""

    async def scenario() -> None:
        async with Deployment(decodes=2, settings=QUICK_CHECKS) as d, ClientSession() as session:
            second = d.decodes[1]
            for fault in ("503", "hang", "stopped"):
                if fault == "503":
                    second.health_status = 503
                elif fault == "hang":
                    second.health_hangs = True
                else:
                    await second.stop()
                await _healthy(d, second, False)
                assert await _answered_by(session, d, 3) == [0, 0, 0]
                second.health_status, second.health_hangs = 200, False
                if fault == "stopped":
                    await second.start()
                await _healthy(d, second, True)
                assert 1 in await _answered_by(session, d, 2)

    asyncio.run(scenario())


def test_a_refused_decode_is_taken_out_at_once_and_the_request_tried_on_another() -> None:
    """With health checks an hour apart, the request that finds the first decode's socket
    closed takes it out of the rotation, and is answered by the second."""

    async def scenario() -> None:
        async with (
            Deployment(decodes=2, settings=ProxySettings(health_interval=3600)) as d,
            ClientSession() as session,
        ):
            first, _ = d.decodes
            await first.stop()
            assert await _answered_by(session, d, 3) == [1, 1, 1]
            metrics = await d.metrics()
            assert metrics.value("kvbridge_proxy_instance_healthy", instance=first.url) == 0
            errors = metrics.value("kvbridge_proxy_upstream_errors_total", instance=first.url)
            assert errors == 1

    asyncio.run(scenario())


def test_every_decode_down_is_a_503_at_once() -> None:
    async def scenario() -> None:
        async with Deployment(decodes=2, settings=QUICK_CHECKS) as d, ClientSession() as session:
            for fake in d.decodes:
                await fake.stop()
            for fake in d.decodes:
                await _healthy(d, fake, False)
            async with session.post(f"{d.url}/v1/completions", json=completion()) as answer:
                assert answer.status == 503 and answer.headers["Retry-After"] == "1"
                assert "no healthy decode" in (await answer.json())["error"]["message"]
            async with session.get(f"{d.url}/v1/models") as answer:
                assert answer.status == 503
            async with session.get(f"{d.url}/health") as answer:
                assert answer.status == 503
                assert (await answer.json())["status"] == "unavailable"
            assert not d.prefills[0].bodies  # no prefill spent on a request decode cannot take

    asyncio.run(scenario())


# -- trying a decode again ------------------------------------------------------------------


def test_a_decode_dropped_before_its_status_is_tried_once_more_on_another() -> None:
    async def scenario() -> None:
        async with Deployment(decodes=2) as d, ClientSession() as session:
            first, second = d.decodes
            first.mode = "drop"
            assert await _answered_by(session, d, 1) == [1]
            second.mode = "drop"
            status, data = await post(session, f"{d.url}/v1/completions", completion())
            assert status == 502 and json.loads(data)["error"]["code"] == 502
            assert (len(first.bodies), len(second.bodies)) == (2, 2)  # two tries each time
            assert first.in_progress == second.in_progress == 0

    asyncio.run(scenario())


def test_a_decode_cut_mid_stream_is_never_tried_again() -> None:
    """The client sees an incomplete answer (not a short whole one); no second decode."""

    async def scenario() -> None:
        async with Deployment(decodes=2) as d, ClientSession() as session:
            first, second = d.decodes
            first.mode = "cut"
            async with session.post(f"{d.url}/v1/completions", json=completion()) as answer:
                assert answer.status == 200
                with pytest.raises(ClientPayloadError):
                    await answer.read()
            assert (len(first.bodies), len(second.bodies)) == (1, 0)
            metrics = await d.metrics()
            cut = metrics.value("kvbridge_proxy_upstream_errors_total", kind="cut")
            assert cut == 1

    asyncio.run(scenario())


# -- the connection bound per instance ------------------------------------------------------


def test_the_connections_to_an_instance_are_bounded_and_prefill_still_flows() -> None:
    """Two connections per instance, five held streams: decode never has more than two at
    once, every prefill still runs (its instance has connections of its own), the three
    waiting requests count as outstanding, and all five end whole once decode goes on."""

    async def scenario() -> None:
        async with (
            Deployment(settings=ProxySettings(connections_per_instance=2)) as d,
            ClientSession() as session,
        ):
            (prefill,), (decode,) = d.prefills, d.decodes
            held = [asyncio.create_task(_stream(session, d.url, "hold")) for _ in range(5)]
            await until(lambda: len(prefill.bodies) == 5, "five prefills")
            await until(lambda: decode.in_progress == 2, "two at decode")
            metrics = await d.metrics()
            assert metrics.value("kvbridge_proxy_outstanding_requests", role="decode") == 5
            decode.release()
            assert all(whole_stream(data) for data in await settled(held, "the held streams end"))
            assert decode.max_in_progress == 2 and len(decode.bodies) == 5

    asyncio.run(scenario())


# -- /v1/models, /health, /metrics ----------------------------------------------------------


def test_v1_models_comes_from_a_healthy_decode() -> None:
    async def scenario() -> None:
        async with Deployment(decodes=2, settings=QUICK_CHECKS) as d, ClientSession() as session:
            first, _ = d.decodes
            first.health_status = 503
            await _healthy(d, first, False)
            for _ in range(2):
                async with session.get(f"{d.url}/v1/models") as answer:
                    assert answer.status == 200
                    assert (await answer.json())["data"] == [{"id": "model-1"}]

    asyncio.run(scenario())


def test_health_is_200_while_a_decode_can_serve() -> None:
    """ok with every instance in; degraded (still 200) without prefill, whose absence only
    costs decode the prompt; 503 without decode."""

    async def scenario() -> None:
        async with Deployment(settings=QUICK_CHECKS) as d, ClientSession() as session:
            (prefill,), (decode,) = d.prefills, d.decodes
            assert await _health(session, d.url) == (200, "ok")
            prefill.health_status = 503
            await _healthy(d, prefill, False)
            assert await _health(session, d.url) == (200, "degraded")
            status, data = await post(session, f"{d.url}/v1/completions", completion())
            assert status == 200 and whole_stream(data)  # decode computed the prompt
            assert not prefill.bodies
            decode.health_status = 503
            await _healthy(d, decode, False)
            assert await _health(session, d.url) == (503, "unavailable")

    asyncio.run(scenario())


async def _health(session: ClientSession, url: str) -> tuple[int, str]:
    async with session.get(f"{url}/health") as answer:
        return answer.status, (await answer.json())["status"]


def test_metrics_count_requests_fallbacks_errors_and_prefill_time() -> None:
    async def scenario() -> None:
        async with Deployment(decodes=2) as d, ClientSession() as session:
            url = f"{d.url}/v1/completions"
            for body in (completion(), completion(), completion(prefill="500")):
                assert (await post(session, url, body))[0] == 200
            d.decodes[0].mode = d.decodes[1].mode = "500"
            assert (await post(session, url, completion()))[0] == 500
            async with session.get(f"{d.url}/metrics") as answer:
                assert answer.content_type == "text/plain"
            metrics = await d.metrics()
        route = {"route": "/v1/completions"}
        assert metrics.value("kvbridge_proxy_requests_total", **route, status="200") == 3
        assert metrics.value("kvbridge_proxy_requests_total", **route, status="500") == 1
        assert metrics.value("kvbridge_proxy_prefill_fallbacks_total", reason="status") == 1
        errors = metrics.value("kvbridge_proxy_upstream_errors_total", kind="status")
        assert errors == 2  # the prefill's 500 and the decode's
        assert metrics.value("kvbridge_proxy_prefill_seconds_count") == 4
        assert metrics.value("kvbridge_proxy_outstanding_requests") == 0
        assert metrics.value("kvbridge_proxy_instance_healthy", role="decode") == 2
        assert metrics.value("kvbridge_proxy_requests_in_progress") == 1  # the scrape

    asyncio.run(scenario())


def test_metrics_count_the_prompt_tokens_each_prefill_computed_and_had_cached() -> None:
    """From each prefill answer's ``usage``; a usage that is missing or makes no sense is
    not counted, and the request is served all the same."""
    usages = [
        {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 64}},
        {"prompt_tokens": 40},  # an instance without --enable-prompt-tokens-details
        {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 11}},  # > prompt
        {"prompt_tokens": True},
        {"prompt_tokens": -3},
        "lots",
        None,
    ]

    async def scenario() -> None:
        async with Deployment() as d, ClientSession() as session:
            for usage in usages:
                status, _ = await post(session, f"{d.url}/v1/completions", completion(usage=usage))
                assert status == 200
            metrics = await d.metrics()
        (prefill,) = d.prefills
        tokens = "kvbridge_proxy_prefill_tokens_total"
        assert metrics.value(tokens, instance=prefill.url, kind="prompt") == 150
        assert metrics.value(tokens, instance=prefill.url, kind="cached") == 64

    asyncio.run(scenario())


def test_closing_the_proxy_ends_every_task_it_started() -> None:
    async def scenario() -> None:
        before = asyncio.all_tasks()
        async with Deployment(prefills=2, decodes=2, settings=QUICK_CHECKS) as d:
            await d.metrics()
        assert asyncio.all_tasks() == before

    asyncio.run(scenario())
