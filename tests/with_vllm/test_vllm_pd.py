"""Prefill/decode disaggregation on two real vLLM OpenAI servers, ``kvbridge proxy`` and
either one ``kvbridge serve`` (pages moved directly) or a cluster of three on etcd (pages
moved through the staging buffer, the GPU path): completions through the proxy equal a
single instance's, and the decode instance computes at most the last block of each prompt
itself."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from etcd_support import ETCD_MISSING, EtcdProcess, until
from harness import BLOCK, PATHS, PROMPTS
from serve import ServeProcess

from kvbridge.store import ClusterClient
from kvbridge.transfer import nixl_available

ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


LOGS = Path(os.environ.get("KVBRIDGE_TEST_LOGS", "/tmp"))


def _vllm(
    model: str, role: str, server: str, port: int, *, extra: dict[str, Any], dtype: str
) -> subprocess.Popen[bytes]:
    transfer = {
        "kv_connector": "KVBridgeConnector",
        "kv_connector_module_path": "kvbridge.bindings.vllm",
        "kv_role": role,
        "kv_connector_extra_config": {"server": server, **extra},
    }
    args = [
        *("--model", model, "--port", str(port), "--host", "127.0.0.1", "--dtype", dtype),
        *("--max-model-len", "512", "--block-size", "32", "--max-num-batched-tokens", "64"),
        *("--seed", "0", "--enforce-eager", "--skip-tokenizer-init"),
        *("--enable-prompt-tokens-details", "--no-enable-prefix-caching"),
        *("--kv-transfer-config", json.dumps(transfer)),
    ]
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args]
    log = (LOGS / f"kvbridge-test-vllm-{role}.log").open("wb")  # read it when a test fails
    return subprocess.Popen(command, env=ENV, stdout=log, stderr=subprocess.STDOUT)


def _wait(
    url: str,
    procs: list[subprocess.Popen[bytes]],
    ready: Callable[[bytes], bool] = lambda body: True,
    timeout: float = 240,
) -> None:
    """Until ``url`` answers with a body that is ``ready`` (a bound, not a timing)."""

    def answered() -> bool:
        if any(p.poll() is not None for p in procs):
            raise AssertionError("a server exited while starting")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                return ready(answer.read())
        except OSError:
            return False

    until(answered, f"{url} ready", timeout=timeout, pause=1)


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        return answer.read()


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


@contextmanager
def deployment(
    model: str, address: str, extra: dict[str, Any], dtype: str = "float32"
) -> Iterator[dict[str, str]]:
    """A prefill and a decode vLLM server whose connectors use the kvbridge at ``address``,
    and ``kvbridge proxy`` in front; yields the URLs of the proxy, prefill and decode once
    the proxy has both in its rotation."""
    with ExitStack() as stack:
        ports = [_port() for _ in range(3)]
        procs = [
            _vllm(model, "kv_producer", address, ports[0], extra=extra, dtype=dtype),
            _vllm(model, "kv_consumer", address, ports[1], extra=extra, dtype=dtype),
        ]
        proxy = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvbridge",
                "proxy",
                "--port",
                str(ports[2]),
                "--prefill",
                f"http://127.0.0.1:{ports[0]}",
                "--decode",
                f"http://127.0.0.1:{ports[1]}",
            ],
            stdout=(LOGS / "kvbridge-test-proxy.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        procs.append(proxy)
        for proc in procs:
            stack.callback(proc.wait, 30)
            stack.callback(proc.terminate)
        for port in ports:
            _wait(f"http://127.0.0.1:{port}/health", procs)
        # The proxy's own health checks must have put both instances in its rotation (a
        # request sent before the prefill was back went to decode alone: it loaded nothing).
        _wait(f"http://127.0.0.1:{ports[2]}/health", procs, lambda body: b'"ok"' in body)
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        yield dict(zip(("prefill", "decode", "proxy"), urls, strict=True))


def complete(proxy: str, model: str, prompt: list[int]) -> tuple[list[int], int]:
    """A greedy completion of ``prompt`` through the proxy: its tokens, and how many of
    the prompt's tokens the decode instance computed itself."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,
    }
    answer = json.loads(_post(f"{proxy}/v1/completions", body))
    usage = answer["usage"]
    computed = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    return answer["choices"][0]["token_ids"], computed


@pytest.fixture(scope="module", params=list(DEPLOYMENTS))
def pd(model: str, request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """The whole deployment; yields the URLs of the proxy, prefill and decode."""
    store, extra = DEPLOYMENTS[request.param]
    if store is _cluster and ETCD_MISSING is not None:
        pytest.skip(ETCD_MISSING)
    with ExitStack() as stack:
        yield stack.enter_context(deployment(model, store(stack), extra))


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
    events = _post(f"{pd['proxy']}/v1/completions", body).decode().split("\n\n")
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
