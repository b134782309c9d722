"""The proxy's upstream vLLM instances: each with its own bounded connection pool, its
requests outstanding and its health; a pool per role that picks the least-loaded healthy
instance; and ``Upstreams``, which owns them all and the health checker.

Routing: a request goes to the healthy instance of its role with the fewest requests
outstanding (sent and not yet answered in full, or waiting for one of the instance's
connections); among equals, the one whose turn it is (round robin), so idle instances share
the work evenly. An instance leaves the rotation when its health check fails or a connection
to it is refused, and comes back when a check passes.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager

from aiohttp import ClientSession, ClientTimeout, TCPConnector

from ._proxy_health import HealthChecker
from ._proxy_settings import CONNECT_TIMEOUT, KEEPALIVE_S, KV_SLACK, ProxySettings, kv_score

_log = logging.getLogger("kvbridge.proxy")

ROLES = ("prefill", "decode")


class Instance:
    """One upstream instance: its URL, its own connection pool (bounded, so a full instance
    never holds up another's requests), and what routing reads."""

    def __init__(self, role: str, url: str, index: int) -> None:
        self.role = role
        self.url = url
        self.index = index
        self.outstanding = 0
        self.healthy = True
        self._session: ClientSession | None = None

    def open(self, connections: int) -> None:
        """Make the connection pool (in the running event loop)."""
        connector = TCPConnector(limit=connections, limit_per_host=0, keepalive_timeout=KEEPALIVE_S)
        timeout = ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT)
        self._session = ClientSession(connector=connector, timeout=timeout)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> ClientSession:
        if self._session is None:
            raise RuntimeError(f"{self.role} {self.url} is not open")
        return self._session

    @contextmanager
    def lease(self) -> Iterator[Instance]:
        """Count a request as outstanding here while the block runs."""
        self.outstanding += 1
        try:
            yield self
        finally:
            self.outstanding -= 1

    def set_health(self, healthy: bool, why: str) -> None:
        """Take the instance out of the rotation or bring it back; log the change once."""
        if healthy == self.healthy:
            return
        self.healthy = healthy
        if healthy:
            _log.info("%s %s is back in the rotation", self.role, self.url)
        else:
            _log.warning("%s %s is out of the rotation: %s", self.role, self.url, why)


class Pool:
    """The instances of one role and the choice between them."""

    def __init__(self, role: str, urls: list[str]) -> None:
        self.role = role
        self.instances = [Instance(role, url, i) for i, url in enumerate(urls)]
        self._turn = 0

    def healthy(self) -> list[Instance]:
        return [instance for instance in self.instances if instance.healthy]

    def pick(
        self, exclude: Collection[Instance] = (), scores: Mapping[str, int] | None = None
    ) -> Instance | None:
        """The least-loaded healthy instance not in ``exclude`` (ties: whose turn it is), or
        ``None`` when there is none. With ``scores`` (``--route kv``: per URL, the prompt's
        tokens it holds; ``""`` for any other), the highest-scoring of those at most
        ``KV_SLACK`` requests busier than the least busy."""
        candidates = [i for i in self.instances if i.healthy and i not in exclude]
        if not candidates:
            return None
        count = len(self.instances)

        def load(i: Instance) -> tuple[int, int]:
            return i.outstanding, (i.index - self._turn) % count

        if scores is not None:
            idle = min(i.outstanding for i in candidates)
            candidates = [i for i in candidates if i.outstanding <= idle + KV_SLACK]
            best = min(candidates, key=lambda i: (-kv_score(scores, i.url), *load(i)))
        else:
            best = min(candidates, key=load)
        self._turn = best.index + 1
        return best


class Upstreams:
    """Every instance of both roles; owns their connection pools and the health checker
    (``start`` opens them all and checks each instance once, ``close`` stops and closes)."""

    def __init__(
        self, prefill_urls: list[str], decode_urls: list[str], settings: ProxySettings
    ) -> None:
        self.prefill = Pool("prefill", prefill_urls)
        self.decode = Pool("decode", decode_urls)
        self._settings = settings
        self._checker: HealthChecker | None = None

    def instances(self) -> list[Instance]:
        return [*self.prefill.instances, *self.decode.instances]

    async def start(self) -> None:
        for instance in self.instances():
            instance.open(self._settings.connections_per_instance)
        self._checker = HealthChecker(
            self.instances(), self._settings.health_interval, self._settings.health_timeout
        )
        await self._checker.start()

    async def close(self) -> None:
        if self._checker is not None:
            await self._checker.close()
        for instance in self.instances():
            await instance.close()

    def suspect(self, instance: Instance, why: str) -> None:
        """A connection to ``instance`` was refused: out of the rotation at once, and the
        health checker looks again now (it brings the instance back if it answers)."""
        instance.set_health(False, why)
        if self._checker is not None:
            self._checker.wake()
