"""Prefill/decode disaggregation on two real vLLM OpenAI servers, ``kvbridge proxy`` and
either one ``kvbridge serve`` (pages moved directly) or a cluster of three on etcd (pages
moved through the staging buffer, the GPU path): completions through the proxy equal a
single instance's, and the decode instance computes at most the last block of each prompt
itself."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from etcd_support import ETCD_MISSING, EtcdProcess, until
from harness import BLOCK, PATHS, PROMPTS
from pd_deployment import complete, deployment, post
from serve import ServeProcess

from kvbridge.store import ClusterClient
from kvbridge.transfer import nixl_available


def _one_server(stack: ExitStack) -> str:
    store = ServeProcess("--host-capacity", "64MiB")
    stack.callback(store.kill)
    return store.address


def _nixl_server(stack: ExitStack) -> str:
    if not nixl_available():
        pytest.skip("NIXL is not installed here (tests/with_vllm/run installs it)")
    store = ServeProcess("--host-capacity", "64MiB", "--transports", "nixl")
    stack.callback(store.kill)
    return store.address


def _cluster(stack: ExitStack) -> str:
    """Three members on an etcd; its URL once etcd lists them all."""
    etcd = stack.enter_context(EtcdProcess())
    for _ in range(3):
        member = ServeProcess("--cluster", etcd.url, "--host-capacity", "64MiB")
        stack.callback(member.kill)
    with ClusterClient(etcd.url, block_bytes=4096) as watcher:
        until(lambda: len(watcher.members()) == 3, "the members in etcd")
    return etcd.url


DEPLOYMENTS: dict[str, tuple[Callable[[ExitStack], str], dict[str, Any]]] = {
    "server-direct": (_one_server, PATHS["direct"]),
    "server-nixl": (_nixl_server, {**PATHS["direct"], "transports": "nixl"}),
    "cluster-staged": (_cluster, PATHS["staged"]),
}
"""Where prefill saves and decode loads, and how pages move."""


@pytest.fixture(scope="module", params=list(DEPLOYMENTS))
def pd(model: str, request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """The whole deployment; yields the URLs of the proxy, prefill and decode."""
    store, extra = DEPLOYMENTS[request.param]
    if store is _cluster and ETCD_MISSING is not None:
        pytest.skip(ETCD_MISSING)
    with ExitStack() as stack:
        made = stack.enter_context(deployment(model, store(stack), extra))
        (prefill,), (decode,) = made.prefills, made.decodes
        yield {"prefill": prefill, "decode": decode, "proxy": made.proxies["proxy"]}


def test_completions_through_the_proxy_equal_a_single_instance(
    pd: dict[str, str], model: str, baseline: list[list[int]]
) -> None:
    for prompt, expected in zip(PROMPTS, baseline, strict=True):
        tokens, computed = complete(pd["proxy"], model, prompt)
        assert tokens == expected
        assert 1 <= computed <= BLOCK  # decode computed at most the last block


def test_a_streamed_completion_passes_through(
    pd: dict[str, str], model: str, baseline: list[list[int]]
) -> None:
    """The proxy hands on the server-sent events, and together they carry the greedy tokens.

    How many events carry them is vLLM's business: its output collector merges the steps a
    slow reader has not yet taken, so the count of events varies with the machine's load.
    """
    body = {
        "model": model,
        "prompt": PROMPTS[0],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    events = post(f"{pd['proxy']}/v1/completions", body).decode().split("\n\n")
    payloads = [event.removeprefix("data: ") for event in events if event.strip()]
    assert all(event.startswith("data: ") for event in events if event.strip())
    assert payloads[-1] == "[DONE]" and len(payloads) >= 2
    chunks = [json.loads(payload)["choices"][0] for payload in payloads[:-1]]
    assert [token for chunk in chunks for token in chunk["token_ids"] or []] == baseline[0][:4]


def test_the_counters_are_in_vllms_prometheus_metrics(pd: dict[str, str], model: str) -> None:
    """After the completions above: decode loaded, prefill saved (vLLM's /metrics)."""

    def counter(url: str, name: str) -> float:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        lines = [ln for ln in text.splitlines() if ln.startswith(f"vllm:kvbridge_{name}_total")]
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)

    # vLLM publishes connector stats every few seconds
    until(lambda: counter(pd["decode"], "tokens_loaded") > 0, "decode's loads", 30, pause=1)
    assert counter(pd["prefill"], "bytes_saved") > 0
