"""Disaggregated deployments for the end-to-end tests: real vLLM OpenAI servers (prefill
instances, decode instances) whose connectors use one kvbridge, and ``kvbridge proxy``
processes in front, each started as an operator starts it; completions sent through them.

Logs go to ``$KVBRIDGE_TEST_LOGS`` (``/tmp`` by default), one file per process: read them
when a test fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from etcd_support import until
from helpers import free_port

ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"}
LOGS = Path(os.environ.get("KVBRIDGE_TEST_LOGS", "/tmp"))


@dataclass(frozen=True)
class Prefill:
    """How the prefill instances run: with vLLM's prefix cache or not, and with it, whether
    each publishes its KV events (``--kv-events-config``, connecting to an endpoint a
    proxy binds)."""

    count: int = 1
    prefix_caching: bool = False
    kv_events: bool = False


@dataclass
class Deployment:
    """The URLs of what runs: prefill and decode instances, proxies by name; per prefill
    URL, the endpoint its KV events go to (where ``Prefill.kv_events``)."""

    prefills: list[str]
    decodes: list[str]
    proxies: dict[str, str] = field(default_factory=dict)
    events: dict[str, str] = field(default_factory=dict)


def vllm_server(
    model: str,
    role: str,
    server: str,
    port: int,
    *,
    extra: dict[str, Any],
    dtype: str,
    prefix_caching: bool = False,
    kv_events: str | None = None,
) -> subprocess.Popen[bytes]:
    """A vLLM OpenAI server of ``role`` on ``port`` whose connector uses ``server``; with
    ``kv_events``, publishing its prefix cache's events to that endpoint."""
    transfer = {
        "kv_connector": "KVBridgeConnector",
        "kv_connector_module_path": "kvbridge.bindings.vllm",
        "kv_role": role,
        "kv_connector_extra_config": {"server": server, **extra},
    }
    caching = "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"
    args = [
        *("--model", model, "--port", str(port), "--host", "127.0.0.1", "--dtype", dtype),
        *("--max-model-len", "512", "--block-size", "32", "--max-num-batched-tokens", "64"),
        *("--seed", "0", "--enforce-eager", "--skip-tokenizer-init"),
        *("--enable-prompt-tokens-details", caching),
        *("--kv-transfer-config", json.dumps(transfer)),
    ]
    if kv_events is not None:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_events}
        args += ["--kv-events-config", json.dumps(events)]
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *args]
    log = (LOGS / f"kvbridge-test-vllm-{role}-{port}.log").open("wb")
    return subprocess.Popen(command, env=ENV, stdout=log, stderr=subprocess.STDOUT)


def proxy_process(
    name: str, port: int, prefills: Sequence[str], decodes: Sequence[str], more: Sequence[str]
) -> subprocess.Popen[bytes]:
    """``kvbridge proxy`` on ``port`` in front of the instances, with flags ``more``."""
    command = [sys.executable, "-m", "kvbridge", "proxy", "--port", str(port)]
    command += [arg for url in prefills for arg in ("--prefill", url)]
    command += [arg for url in decodes for arg in ("--decode", url)]
    log = (LOGS / f"kvbridge-test-proxy-{name}.log").open("wb")
    return subprocess.Popen([*command, *more], stdout=log, stderr=subprocess.STDOUT)


def wait_ready(
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


def post(url: str, body: dict[str, Any]) -> bytes:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        data: bytes = answer.read()
        return data


@contextmanager
def deployment(
    model: str,
    address: str,
    extra: dict[str, Any],
    dtype: str = "float32",
    *,
    prefill: Prefill = Prefill(),
    proxies: Callable[[Deployment], dict[str, list[str]]] = lambda d: {"proxy": []},
) -> Iterator[Deployment]:
    """``prefill.count`` prefill instances and one decode instance whose connectors use the
    kvbridge at ``address``, and a ``kvbridge proxy`` for each name ``proxies`` gives (with
    the flags it gives, told of the deployment's instances and event endpoints) in front.
    Yields once every proxy has every instance in its rotation."""
    with ExitStack() as stack:
        prefill_ports = [free_port() for _ in range(prefill.count)]
        decode_port = free_port()
        events = [_endpoint() if prefill.kv_events else None for _ in prefill_ports]
        procs = [
            vllm_server(
                model,
                "kv_producer",
                address,
                port,
                extra=extra,
                dtype=dtype,
                prefix_caching=prefill.prefix_caching,
                kv_events=endpoint,
            )
            for port, endpoint in zip(prefill_ports, events, strict=True)
        ]
        procs.append(
            vllm_server(model, "kv_consumer", address, decode_port, extra=extra, dtype=dtype)
        )
        urls = [f"http://127.0.0.1:{port}" for port in [*prefill_ports, decode_port]]
        made = Deployment(
            prefills=urls[:-1],
            decodes=urls[-1:],
            events={url: e for url, e in zip(urls, events, strict=False) if e is not None},
        )
        for name, flags in proxies(made).items():
            port = free_port()
            procs.append(proxy_process(name, port, made.prefills, made.decodes, flags))
            made.proxies[name] = f"http://127.0.0.1:{port}"
        for proc in procs:
            stack.callback(proc.wait, 30)
            stack.callback(proc.terminate)
        for url in urls + list(made.proxies.values()):
            wait_ready(f"{url}/health", procs)
        # The proxies' own health checks must have put every instance in their rotation (a
        # request sent before the prefill was back went to decode alone: it loaded nothing).
        for url in made.proxies.values():
            wait_ready(f"{url}/health", procs, lambda body: b'"ok"' in body)
        yield made


def _endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


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
    answer = json.loads(post(f"{proxy}/v1/completions", body))
    usage = answer["usage"]
    computed = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    return answer["choices"][0]["token_ids"], computed
