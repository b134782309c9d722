"""The proxy soak: ``kvbridge proxy`` (its own process) in front of three prefill and three
decode instances, for ``KVBRIDGE_PROXY_SOAK_S`` seconds (12 by default), under twelve
clients that send completions of every kind: whole streams, answers in one piece, clients
that leave mid-stream or while decode is silent, prefills that answer something odd or
stall past the prefill timeout, decodes that err, drop the connection before a status, or
cut their stream. Meanwhile instances die: four of the six are processes that get SIGKILL,
two are servers in this process that stop; each starts again on its port a moment later.

What must hold:

- every request ends (no client waits past its 30 s hang detector) in an answer its kind
  allows, and a 200 stream that ends cleanly is whole (a cut one is never passed off as
  whole);
- afterwards every instance is back in the rotation, a fresh request is served at once,
  and the proxy is idle again: no request outstanding or in progress, its asyncio tasks
  back to their count at start, no upstream request in progress and no connection open
  to any instance (the instances' own count); no traceback in its log, and it stops
  cleanly on SIGTERM.

``KVBRIDGE_PROXY_SOAK_SEED`` replays a run (the seed is printed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="kvbridge proxy needs aiohttp (the proxy extra)")
from aiohttp import ClientError, ClientPayloadError, ClientSession, ClientTimeout
from proxy_support import (
    FakeVllm,
    ProxyProcess,
    UpstreamProcess,
    completion,
    scrape,
    settled,
    until_async,
    whole_stream,
)

SOAK_S = float(os.environ.get("KVBRIDGE_PROXY_SOAK_S", "12"))
CLIENTS = 12
HANG = ClientTimeout(total=30)
"""A request still unanswered after this long is a hang (a failure, not a timing)."""
PROXY_FLAGS = (
    *("--health-interval", "0.25", "--health-timeout", "1"),
    *("--prefill-timeout", "1", "--connections-per-instance", "8"),
)
ODD_PREFILLS = ("list", "notjson", "noparams", "500", "drop", "cut", "stall")
KINDS = {
    "stream": 30,
    "json": 10,
    "leave_streaming": 15,
    "leave_silent": 10,
    "odd_prefill": 15,
    "decode_500": 7,
    "decode_drop": 6,
    "decode_cut": 7,
}
DOWN = {"502", "503"}
"""What any request may get while instances die: no instance answered (or none is up)."""
ALLOWED = {
    "stream": {"whole", "cut"} | DOWN,
    "json": {"json", "cut"} | DOWN,
    "odd_prefill": {"whole", "cut"} | DOWN,
    "decode_500": {"500", "cut"} | DOWN,
    "decode_drop": DOWN,
    "decode_cut": {"cut"} | DOWN,
}
"""Outcomes by kind. ``cut``: the answer broke off (its decode instance died mid-answer, or
cut it on purpose)."""
LEAVERS_MAY_SEE = {"500", "cut"} | DOWN
"""A client that means to leave may get an answer first: a stalled decode that stops
answers 500, one that dies cuts the stream or leaves none to answer."""


@dataclasses.dataclass
class _Tally:
    sent: int = 0
    left: int = 0
    outcomes: Counter[str] = dataclasses.field(default_factory=Counter)
    wrong: list[str] = dataclasses.field(default_factory=list)


@pytest.mark.slow
def test_proxy_soak(tmp_path: Path) -> None:
    seed = int(os.environ.get("KVBRIDGE_PROXY_SOAK_SEED", random.randrange(1 << 32)))
    print(f"proxy soak: seed {seed}, {SOAK_S} s")
    asyncio.run(_soak(tmp_path, random.Random(seed)))


async def _soak(tmp_path: Path, rng: random.Random) -> None:
    processes = [UpstreamProcess(role) for role in ("prefill", "prefill", "decode", "decode")]
    servers = [FakeVllm("prefill"), FakeVllm("decode")]
    upstreams: list[UpstreamProcess | FakeVllm] = [*processes, *servers]
    await settled([asyncio.create_task(u.start()) for u in upstreams], "the instances start")
    prefill, decode = ([u.url for u in upstreams if u.role == r] for r in ("prefill", "decode"))
    proxy = ProxyProcess(prefill, decode, tmp_path / "proxy.log", *PROXY_FLAGS)
    try:
        await proxy.start()
        idle_tasks = min([(await scrape(proxy.url)).value("kvbridge_proxy_tasks") for _ in "123"])
        tally = await _load(proxy.url, rng, processes, servers)
        await _all_back(proxy.url)
        await _served_at_once(proxy.url)
        await _idle(proxy.url, idle_tasks, processes, servers)
        await _counted(proxy.url, tally)
    finally:
        for server in servers:
            await server.stop()
        for process in processes:
            await process.kill()
        status = await proxy.stop()
    assert "Traceback" not in proxy.log(), proxy.log()[-5000:]
    assert status == 0, proxy.log()[-2000:]


async def _load(
    url: str, rng: random.Random, processes: list[UpstreamProcess], servers: list[FakeVllm]
) -> _Tally:
    """The clients and the killer, for ``SOAK_S`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SOAK_S
    tally = _Tally()
    seeds = [rng.randrange(1 << 32) for _ in range(CLIENTS + 1)]
    stop = asyncio.Event()
    killer = asyncio.create_task(
        _kill_and_restart(random.Random(seeds[0]), stop, [*processes, *servers])
    )
    clients = [
        asyncio.create_task(_client(url, random.Random(seed), deadline, tally))
        for seed in seeds[1:]
    ]
    try:
        await settled(clients, "the clients end", timeout=SOAK_S + 60)
    finally:
        stop.set()
        (deaths,) = await settled([killer], "the killer ends")
    print(f"proxy soak: {tally.sent} requests, {tally.outcomes}, deaths {dict(deaths)}")
    assert not tally.wrong, tally.wrong[:20]
    assert tally.sent >= 200 and tally.outcomes["whole"] >= 50 and tally.left >= 20, tally
    assert deaths["SIGKILL"] >= 2 and deaths["stopped"] >= 1, deaths
    return tally


async def _client(url: str, rng: random.Random, deadline: float, tally: _Tally) -> None:
    loop = asyncio.get_running_loop()
    async with ClientSession(timeout=HANG) as session:
        while loop.time() < deadline:
            kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
            tally.sent += 1
            try:
                outcome = await _request(session, url, kind, rng)
            except asyncio.TimeoutError:
                tally.wrong.append(f"{kind}: hung")
                continue
            if outcome == "left":
                tally.left += 1
            elif outcome == "503":
                await asyncio.sleep(0.1)  # as a client heeding Retry-After would (pacing)
            elif outcome not in ALLOWED.get(kind, LEAVERS_MAY_SEE):
                tally.wrong.append(f"{kind}: {outcome}")
            tally.outcomes[outcome] += 1


async def _request(session: ClientSession, url: str, kind: str, rng: random.Random) -> str:
    """Send one request of ``kind``; what became of it."""
    if kind == "leave_silent":
        try:
            return await asyncio.wait_for(
                _answer(session, url, completion("stall")), rng.uniform(0.05, 0.3)
            )
        except asyncio.TimeoutError:
            return "left"
    if kind == "leave_streaming":
        body = completion("trickle")
        async with session.post(f"{url}/v1/completions", json=body) as answer:
            if answer.status != 200:
                return str(answer.status)
            await answer.content.readany()
            return "left"  # leaving the block unread closes the connection
    body = {
        "stream": completion(),
        "json": completion(stream=False),
        "odd_prefill": completion(prefill=rng.choice(ODD_PREFILLS)),
        "decode_500": completion("500"),
        "decode_drop": completion("drop"),
        "decode_cut": completion("cut"),
    }[kind]
    return await _answer(session, url, body)


async def _answer(session: ClientSession, url: str, body: dict[str, object]) -> str:
    try:
        async with session.post(f"{url}/v1/completions", json=body) as answer:
            data = await answer.read()
            if answer.status != 200:
                return str(answer.status)
    except ClientPayloadError:
        return "cut"
    except ClientError as exc:
        return f"client error {exc!r}"
    if body.get("stream"):
        return "whole" if whole_stream(data) else f"short: {data[-80:]!r}"
    return "json" if b'"decoded"' in data else f"bad json: {data[:80]!r}"


async def _kill_and_restart(
    rng: random.Random, stop: asyncio.Event, victims: list[UpstreamProcess | FakeVllm]
) -> Counter[str]:
    """Until ``stop``: every half second or so, the next instance (all of them in turn, in
    a shuffled order) dies (SIGKILL, or its server stops) and starts again on its port a
    moment later, so that at times several are down at once. Deaths by kind."""
    deaths: Counter[str] = Counter()
    down: set[asyncio.Task[None]] = set()
    order: list[UpstreamProcess | FakeVllm] = []
    while not await _stopped(stop, rng.uniform(0.4, 1.0)):
        order = order or rng.sample(victims, len(victims))
        victim = order.pop()
        if any(task.get_name() == str(id(victim)) for task in down):
            continue  # still down
        if isinstance(victim, UpstreamProcess):
            await victim.kill()
            deaths["SIGKILL"] += 1
        else:
            await victim.stop()
            deaths["stopped"] += 1
        task = asyncio.create_task(_restart(victim, rng.uniform(0.2, 1.5)), name=str(id(victim)))
        down.add(task)
        task.add_done_callback(down.discard)
    await settled(list(down), "the dead instances start again")
    return deaths


async def _restart(victim: UpstreamProcess | FakeVllm, after: float) -> None:
    await asyncio.sleep(after)  # down for a while (a fault's length, not a check)
    await victim.start()


async def _stopped(stop: asyncio.Event, seconds: float) -> bool:
    """Whether ``stop`` is set within ``seconds``."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except asyncio.TimeoutError:
        return False
    return True


async def _all_back(url: str) -> None:
    async def all_healthy() -> bool:
        metrics = await scrape(url)
        return metrics.value("kvbridge_proxy_instance_healthy") == 6

    await until_async(all_healthy, "every instance back in the rotation")


async def _served_at_once(url: str) -> None:
    async with (
        ClientSession(timeout=ClientTimeout(total=10)) as session,
        session.post(f"{url}/v1/completions", json=completion()) as answer,
    ):
        assert answer.status == 200 and whole_stream(await answer.read())


async def _idle(
    url: str, idle_tasks: float, processes: list[UpstreamProcess], servers: list[FakeVllm]
) -> None:
    async def proxy_idle() -> bool:
        metrics = await scrape(url)
        return (
            metrics.value("kvbridge_proxy_outstanding_requests") == 0
            and metrics.value("kvbridge_proxy_requests_in_progress") == 1  # the scrape
            and metrics.value("kvbridge_proxy_tasks") <= idle_tasks
        )

    async def upstreams_idle() -> bool:
        stats = [await process.stats() for process in processes]
        busy = [s for s in stats if s["in_progress"] or s["connections"]]
        return not busy and not any(s.in_progress or s.connections for s in servers)

    await until_async(proxy_idle, "the proxy idle: nothing outstanding, tasks as at start")
    await until_async(upstreams_idle, "no upstream request in progress, no connection open")


async def _counted(url: str, tally: _Tally) -> None:
    """The proxy's counters saw what the clients did."""
    metrics = await scrape(url)
    answered = sum(
        metrics.value("kvbridge_proxy_requests_total", route=route)
        for route in ("/v1/completions",)
    )
    assert tally.sent - tally.left + 1 <= answered <= tally.sent + 1, (answered, tally)
    assert metrics.value("kvbridge_proxy_client_disconnects_total") >= 1
    assert metrics.value("kvbridge_proxy_prefill_fallbacks_total") >= 1
    for kind in ("refused", "dropped", "cut", "status"):
        assert metrics.value("kvbridge_proxy_upstream_errors_total", kind=kind) >= 1, kind
