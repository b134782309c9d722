"""``kvbridge proxy --route kv`` end to end: two vLLM prefill instances (prefix cache on, each
publishing its KV events to the proxy, ``--kv-events-config``), one decode instance, one
``kvbridge serve`` between them, and two proxies in front of the same instances, one routing
by cache and one by load (``least-loaded``, the default). Through each, a multi-turn
conversation workload from the Mooncake trace (``conversations.py``), the two of the same
shape and sharing no token: every completion equals a single vLLM's, and the prefill
instances compute fewer of the prompts' tokens behind ``--route kv`` than behind
``least-loaded`` (each prefill answer's ``prompt_tokens_details.cached_tokens``, counted by
the proxy: ``kvbridge_proxy_prefill_tokens_total``). The figures go to
``$KVBRIDGE_TEST_LOGS/kvbridge-test-route-kv.json``."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from conversations import Turn, reusable, workload
from harness import BLOCK, run_engine, tokens
from pd_deployment import LOGS, Deployment, Prefill, complete, deployment
from prometheus_client.parser import text_string_to_metric_families
from serve import ServeProcess

CONVERSATIONS = 8
"""35 requests, 8,349 prompt tokens, 5,760 of them reusable by an instance that ran the
conversation's earlier turns (``reusable``)."""

MAX_BLOCKS = 15  # 480 tokens and 8 to answer fit the instances' --max-model-len 512
Outputs = dict[tuple[int, ...], list[int]]
"""Greedy output tokens by prompt."""

POLICIES = ("least-loaded", "kv")
CLIENTS = ("one-by-one", "conversations-at-once")
"""How the workload is sent: one request after another in trace order, or each
conversation by a client of its own, all at once (a turn once the one before it is
answered)."""


def _seed(client: str, policy: str) -> int:
    """Each (client, policy) its workload: the same conversations, no token in common."""
    return 1 + CLIENTS.index(client) * len(POLICIES) + POLICIES.index(policy)


def _workloads(client: str) -> dict[str, list[Turn]]:
    return {
        policy: workload(
            CONVERSATIONS, block=BLOCK, max_blocks=MAX_BLOCKS, seed=_seed(client, policy)
        )
        for policy in POLICIES
    }


def _proxies(made: Deployment) -> dict[str, list[str]]:
    events = [f"{url}={endpoint}" for url, endpoint in made.events.items()]
    kv = ["--route", "kv", "--block-size", str(BLOCK)]
    return {"least-loaded": [], "kv": [*kv, *(f for e in events for f in ("--kv-events", e))]}


@pytest.fixture(scope="module")
def deployed(model: str) -> Iterator[Deployment]:
    """The instances, and a proxy per policy (each instance's events go to one endpoint,
    which the ``kv`` proxy binds)."""
    server = ServeProcess("--host-capacity", "64MiB")
    prefill = Prefill(count=2, prefix_caching=True, kv_events=True)
    try:
        with deployment(model, server.address, {}, prefill=prefill, proxies=_proxies) as made:
            yield made
    finally:
        server.kill()


@pytest.fixture(scope="module")
def alone(model: str) -> Outputs:
    """Every workload's greedy outputs from a single vLLM without a connector."""
    prompts = [t.prompt for c in CLIENTS for turns in _workloads(c).values() for t in turns]
    outputs = tokens(run_engine({"model": model, "prompts": prompts, "connector": None}))
    return {tuple(p): out for p, out in zip(prompts, outputs, strict=True)}


def _prefill_tokens(proxy: str, prefills: list[str]) -> dict[str, Any]:
    """The proxy's counts: its prefills' prompt tokens by kind (prompt, cached) and per
    instance, and ``--route kv``'s routed tokens."""
    with urllib.request.urlopen(f"{proxy}/metrics", timeout=10) as answer:
        families = text_string_to_metric_families(answer.read().decode())
        samples = [(s.name, s.labels, s.value) for family in families for s in family.samples]
    counted: dict[str, Any] = {"prompt": 0, "cached": 0, "routed": 0, "by_instance": [0, 0]}
    for name, labels, value in samples:
        if name == "kvbridge_proxy_prefill_tokens_total":
            counted[labels["kind"]] += int(value)
            if labels["kind"] == "prompt":
                counted["by_instance"][prefills.index(labels["instance"])] += int(value)
        elif name == "kvbridge_proxy_kv_routed_tokens_total":
            counted["routed"] += int(value)
    return counted


def _since(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What was counted between two scrapes."""
    return {
        k: [a - b for a, b in zip(v, before[k], strict=True)]
        if isinstance(v, list)
        else v - before[k]
        for k, v in after.items()
    }


def _send(proxy: str, model: str, turns: list[Turn], expected: Outputs) -> None:
    for turn in turns:
        answer, decode_computed = complete(proxy, model, turn.prompt)
        assert answer == expected[tuple(turn.prompt)]
        assert 1 <= decode_computed <= BLOCK  # decode loaded what prefill saved


def _run(client: str, proxy: str, model: str, turns: list[Turn], expected: Outputs) -> None:
    if client == "one-by-one":
        _send(proxy, model, turns, expected)
        return
    by_conversation: dict[int, list[Turn]] = {}
    for turn in turns:
        by_conversation.setdefault(turn.conversation, []).append(turn)
    with ThreadPoolExecutor(len(by_conversation)) as pool:
        sent = [
            pool.submit(_send, proxy, model, mine, expected) for mine in by_conversation.values()
        ]
        for future in sent:
            future.result()


@pytest.mark.parametrize("client", CLIENTS)
def test_route_kv_computes_fewer_prompt_tokens_than_least_loaded_with_equal_outputs(
    deployed: Deployment, model: str, alone: Outputs, client: str
) -> None:
    workloads = _workloads(client)
    figures = {}
    for policy, turns in workloads.items():
        proxy = deployed.proxies[policy]
        before = _prefill_tokens(proxy, deployed.prefills)
        _run(client, proxy, model, turns, alone)
        counted = _since(before, _prefill_tokens(proxy, deployed.prefills))
        prompts = [t.prompt for t in turns]
        assert counted["prompt"] == sum(map(len, prompts))
        figures[policy] = {
            **counted,
            "requests": len(turns),
            "computed": counted["prompt"] - counted["cached"],
            "reusable": reusable(prompts, BLOCK),
        }
    _record(client, figures)
    kv, by_load = figures["kv"], figures["least-loaded"]
    assert kv["computed"] < by_load["computed"], figures
    if client == "one-by-one":
        # vLLM cannot have cached more than an instance that ran every earlier turn would,
        # and the proxy chose each instance for tokens it knew were there
        assert kv["cached"] <= kv["reusable"], figures
        assert kv["routed"] >= kv["cached"], figures


def _record(client: str, figures: dict[str, Any]) -> None:
    path = LOGS / "kvbridge-test-route-kv.json"
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        recorded = {}
    path.write_text(json.dumps({**recorded, client: figures}, indent=2))
