"""The cache server's Prometheus metrics (one registry per server, so several can coexist).

Request counts, latency histograms and errors are recorded as requests are answered; store
figures (hits, misses, bytes, occupancy per tier, evictions) are read from each namespace's
store when Prometheus scrapes, so they can never drift from what ``stats`` reports.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .._stats import StoreStats
from ._metrics_http import MetricsHTTP
from ._served import LOST_REASONS, Served

_LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.5, 1.0)


class ServerMetrics:
    """What the server records, and the HTTP endpoint that exposes it."""

    def __init__(
        self,
        stores: Callable[[], dict[str, StoreStats]],
        refusals: Callable[[], dict[str, int]] = dict,
        served: Callable[[], dict[str, Served]] = dict,
    ) -> None:
        """``stores``: each namespace's figures; ``refusals``: connections and handshakes
        the engine refused, by kind; ``served``: each namespace's stored-versus-served
        account (all read when Prometheus scrapes)."""
        self.registry = CollectorRegistry()
        self.requests = Histogram(
            "kvbridge_request_seconds",
            "Time to answer a control request, by op",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.errors = Counter(
            "kvbridge_request_errors",
            "Refused requests, by op and error kind",
            ["op", "kind"],
            registry=self.registry,
        )
        self.saved = Counter(
            "kvbridge_dedup_saved_bytes",
            "Bytes clients did not send because the blocks were already stored",
            registry=self.registry,
        )
        self.registry.register(_StoreCollector(stores))
        self.registry.register(_RefusalCollector(refusals))
        self.registry.register(_ServedCollector(served))
        self._http: MetricsHTTP | None = None

    def serve(self, host: str, port: int, *, token: str | None = None) -> int:
        """Start the HTTP endpoint (``_metrics_http``); return its port (useful with port
        0). With ``token``, a scrape must send ``Authorization: Bearer <token>`` (else 401)."""
        self._http = MetricsHTTP(host, port, self._render, token=token)
        return self._http.port

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None

    def _render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def metrics_token(secret: bytes) -> str:
    """The bearer token a scraper sends to a server with ``secret``: derived one way from
    it, so the scraper's credential opens the metrics and nothing else."""
    return hmac.new(secret, b"kvbridge-metrics", hashlib.sha256).hexdigest()


class _StoreCollector(Collector):
    def __init__(self, stores: Callable[[], dict[str, StoreStats]]) -> None:
        self._stores = stores

    def collect(self) -> Iterator[Any]:
        counters = {
            "hits": "Blocks read by clients",
            "misses": "Blocks asked for and absent",
            "puts": "Blocks newly stored",
            "duplicates": "Blocks offered that were already stored",
            "bytes_in": "Bytes of blocks stored",
            "bytes_out": "Bytes of blocks read",
            "evictions": "Blocks dropped from the store to make room",
            "demotions": "Blocks moved down a tier to make room",
            "promotions": "Blocks copied up to the top tier on a hit",
            "corrupt": "Blocks that failed their checksum",
        }
        families = {
            name: CounterMetricFamily(f"kvbridge_{name}", doc, labels=["namespace"])
            for name, doc in counters.items()
        }
        blocks = GaugeMetricFamily(
            "kvbridge_tier_blocks", "Blocks held, per tier", labels=["namespace", "tier"]
        )
        capacity = GaugeMetricFamily(
            "kvbridge_tier_capacity_blocks", "Blocks a tier can hold", labels=["namespace", "tier"]
        )
        tier_evictions = CounterMetricFamily(
            "kvbridge_tier_evictions",
            "Blocks that left a tier to make room",
            labels=["namespace", "tier"],
        )
        for namespace, stats in self._stores().items():
            for name, family in families.items():
                family.add_metric([namespace], getattr(stats, name))
            for tier in stats.tiers:
                blocks.add_metric([namespace, tier.name], tier.blocks)
                capacity.add_metric([namespace, tier.name], tier.capacity_blocks)
                tier_evictions.add_metric([namespace, tier.name], tier.evictions)
        yield from families.values()
        yield from (blocks, capacity, tier_evictions)


class _RefusalCollector(Collector):
    def __init__(self, refusals: Callable[[], dict[str, int]]) -> None:
        self._refusals = refusals

    def collect(self) -> Iterator[Any]:
        family = CounterMetricFamily(
            "kvbridge_refused",
            "Connections, handshakes and streams the engine refused, by kind",
            labels=["kind"],
        )
        for kind, count in sorted(self._refusals().items()):
            family.add_metric([kind], count)
        yield family


class _ServedCollector(Collector):
    def __init__(self, served: Callable[[], dict[str, Served]]) -> None:
        self._served = served

    def collect(self) -> Iterator[Any]:
        labels = ["namespace"]
        lookups = CounterMetricFamily(
            "kvbridge_lookups", "Lookups (contains, match) answered", labels=labels
        )
        advertised = CounterMetricFamily(
            "kvbridge_hits_advertised", "Blocks lookups said are held", labels=labels
        )
        delivered = CounterMetricFamily(
            "kvbridge_hits_delivered", "Blocks pinned for a reader", labels=labels
        )
        lost = CounterMetricFamily(
            "kvbridge_hits_lost",
            "Blocks (reads, for lease) not delivered, by reason: gone (absent at the pin), "
            "corrupt (bad in the store: dropped), transfer (went bad on the way), lease "
            "(read past its lease)",
            labels=["namespace", "reason"],
        )
        write_only = GaugeMetricFamily(
            "kvbridge_write_only",
            "1 while the namespace stored bytes and delivered no block for its alarm's window",
            labels=labels,
        )
        for namespace, account in self._served().items():
            lookups.add_metric([namespace], account.lookups)
            advertised.add_metric([namespace], account.advertised)
            delivered.add_metric([namespace], account.delivered)
            for reason in LOST_REASONS:
                lost.add_metric([namespace, reason], account.lost[reason])
            write_only.add_metric([namespace], int(account.write_only))
        yield from (lookups, advertised, delivered, lost, write_only)
