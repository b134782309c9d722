"""The proxy's Prometheus metrics, in a registry of its own (one per app, so two proxies in
one process never share a counter), served as text at ``GET /metrics``.

Counters: ``kvbridge_proxy_requests_total{route,status}`` (status 499: the client went away
first), ``kvbridge_proxy_prefill_fallbacks_total{reason}`` (decode computed the prompt),
``kvbridge_proxy_upstream_errors_total{role,instance,kind}``,
``kvbridge_proxy_client_disconnects_total``, ``kvbridge_proxy_prefill_tokens_total{instance,kind}``
(from each prefill answer's ``usage``: ``prompt`` tokens, and of them ``cached``, those the
instance did not compute, from its prefix cache or loaded by its connector; vLLM reports them
with ``--enable-prompt-tokens-details``). Histogram: ``kvbridge_proxy_prefill_seconds``.
Gauges, read when scraped: ``kvbridge_proxy_outstanding_requests{role,instance}``,
``kvbridge_proxy_instance_healthy{role,instance}`` (1 in the rotation, 0 out),
``kvbridge_proxy_requests_in_progress`` (requests being handled, the scrape's own included),
``kvbridge_proxy_tasks`` (asyncio tasks alive in the proxy's event loop, the scrape's
included: once idle, it is back to its count at start), ``kvbridge_proxy_client_connections``
(open, the scrape's own included) and ``kvbridge_proxy_client_connections_max`` (the cap);
read from the client connections ledger too: ``kvbridge_proxy_client_connections_closed_total
{reason}`` (``head_timeout``, ``body_timeout``, ``idle_timeout``, ``over_cap``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from ._proxy_clients import ClientConnections
from ._proxy_upstreams import Upstreams

CONTENT_TYPE = CONTENT_TYPE_LATEST

PREFILL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
"""From a cached short prompt (milliseconds) to the default prefill timeout (600 s)."""


class ProxyMetrics:
    def __init__(
        self, upstreams: Upstreams, clients: ClientConnections, in_progress: Callable[[], int]
    ) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "kvbridge_proxy_requests",
            "Requests answered, by route and HTTP status (499: the client went away first)",
            ["route", "status"],
            registry=self.registry,
        )
        self._fallbacks = Counter(
            "kvbridge_proxy_prefill_fallbacks",
            "Requests whose prefill failed, so decode computed the prompt, by reason",
            ["reason"],
            registry=self.registry,
        )
        self._errors = Counter(
            "kvbridge_proxy_upstream_errors",
            "Upstream requests that failed (refused, dropped, cut mid-answer, 5xx, timed out)",
            ["role", "instance", "kind"],
            registry=self.registry,
        )
        self._disconnects = Counter(
            "kvbridge_proxy_client_disconnects",
            "Requests whose client went away before the answer ended",
            registry=self.registry,
        )
        self._routed = Counter(
            "kvbridge_proxy_kv_routed_tokens",
            "--route kv: prompt tokens the chosen prefill instance held or could load, by "
            "whether it was the best-placed instance (hit) or another (load: the best one "
            "was busier than the slack)",
            ["choice"],
            registry=self.registry,
        )
        self._unrouted = Counter(
            "kvbridge_proxy_kv_unrouted",
            "--route kv: requests routed by load alone (a text prompt, a chat, a batch)",
            registry=self.registry,
        )
        self._prefill_tokens = Counter(
            "kvbridge_proxy_prefill_tokens",
            "Prompt tokens of prefills answered, by instance and kind: prompt (all), cached "
            "(of them, not computed: held in the instance's prefix cache or loaded)",
            ["instance", "kind"],
            registry=self.registry,
        )
        self._prefill = Histogram(
            "kvbridge_proxy_prefill_seconds",
            "Time from a request's arrival to the end of its prefill (answer or failure)",
            buckets=PREFILL_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_Gauges(upstreams, in_progress))
        self.registry.register(_Clients(clients))

    def request(self, route: str, status: int) -> None:
        self._requests.labels(route=route, status=str(status)).inc()

    def fallback(self, reason: str) -> None:
        self._fallbacks.labels(reason=reason).inc()

    def upstream_error(self, role: str, instance: str, kind: str) -> None:
        self._errors.labels(role=role, instance=instance, kind=kind).inc()

    def kv_routed(self, tokens: int, *, best: bool) -> None:
        self._routed.labels(choice="hit" if best else "load").inc(tokens)

    def kv_unrouted(self) -> None:
        self._unrouted.inc()

    def prefill_tokens(self, instance: str, prompt: int, cached: int | None) -> None:
        """A prefill's usage: its prompt tokens and, where reported, how many were cached."""
        self._prefill_tokens.labels(instance=instance, kind="prompt").inc(prompt)
        if cached is not None:
            self._prefill_tokens.labels(instance=instance, kind="cached").inc(cached)

    def client_disconnect(self) -> None:
        self._disconnects.inc()

    def prefill_time(self, seconds: float) -> None:
        self._prefill.observe(seconds)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _Gauges(Collector):
    """The gauges, read from the live state at each scrape (nothing to keep in step)."""

    def __init__(self, upstreams: Upstreams, in_progress: Callable[[], int]) -> None:
        self._upstreams = upstreams
        self._in_progress = in_progress

    def collect(self) -> Iterator[Metric]:
        labels = ["role", "instance"]
        outstanding = GaugeMetricFamily(
            "kvbridge_proxy_outstanding_requests",
            "Requests sent to an instance (or waiting for its connections), not yet answered",
            labels=labels,
        )
        healthy = GaugeMetricFamily(
            "kvbridge_proxy_instance_healthy",
            "1 while an instance is in the rotation, 0 while it is out",
            labels=labels,
        )
        for instance in self._upstreams.instances():
            outstanding.add_metric([instance.role, instance.url], instance.outstanding)
            healthy.add_metric([instance.role, instance.url], int(instance.healthy))
        yield outstanding
        yield healthy
        yield GaugeMetricFamily(
            "kvbridge_proxy_requests_in_progress",
            "Requests being handled (the scrape's own included)",
            value=self._in_progress(),
        )
        yield GaugeMetricFamily(
            "kvbridge_proxy_tasks",
            "asyncio tasks alive in the proxy's event loop (the scrape's own included)",
            value=len(_tasks()),
        )


def _tasks() -> set[asyncio.Task[object]]:
    try:
        return asyncio.all_tasks()
    except RuntimeError:  # scraped outside the loop (a test reading the registry)
        return set()


class _Clients(Collector):
    """The client connections ledger's numbers, read at each scrape."""

    def __init__(self, clients: ClientConnections) -> None:
        self._clients = clients

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "kvbridge_proxy_client_connections",
            "Client connections open (the scrape's own included)",
            value=len(self._clients),
        )
        yield GaugeMetricFamily(
            "kvbridge_proxy_client_connections_max",
            "Client connections at most: past it the quietest waiting one is closed",
            value=self._clients.cap,
        )
        closed = CounterMetricFamily(
            "kvbridge_proxy_client_connections_closed",
            "Client connections the proxy closed, by reason (a deadline passed; over the cap)",
            labels=["reason"],
        )
        for reason, count in sorted(self._clients.closed.items()):
            closed.add_metric([reason], count)
        yield closed
