"""The proxy's health checker: ``GET /health`` on every upstream instance, all at once, once
per interval (and at once when a request found an instance unreachable); 200 within the
timeout keeps or brings an instance in, anything else takes it out.

One task, owned by ``HealthChecker``: ``start`` checks every instance once and starts it,
``close`` cancels it and waits for it. Checks use their own connections, one per check
(closed after it), so a full instance pool never delays a check and a connection the
instance is closing never fails one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector

from ._fail import one_line

if TYPE_CHECKING:
    from ._proxy_upstreams import Instance

_log = logging.getLogger("kvbridge.proxy")


class HealthChecker:
    def __init__(self, instances: list[Instance], interval: float, timeout: float) -> None:
        self._instances = instances
        self._interval = interval
        self._timeout = ClientTimeout(total=timeout)
        self._wake = asyncio.Event()
        self._session: ClientSession | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Check every instance once, then keep checking in the background."""
        self._session = ClientSession(connector=TCPConnector(force_close=True, limit=0))
        await self.check_all()
        self._task = asyncio.create_task(self._run(), name="kvbridge-proxy-health")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._session is not None:
            await self._session.close()

    def wake(self) -> None:
        """Check again now rather than at the end of the interval."""
        self._wake.set()

    async def check_all(self) -> None:
        if self._session is None:
            raise RuntimeError("the health checker is not started")
        session = self._session
        await asyncio.gather(*(self._check(session, instance) for instance in self._instances))

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval)
            self._wake.clear()
            await self.check_all()

    async def _check(self, session: ClientSession, instance: Instance) -> None:
        try:
            async with session.get(f"{instance.url}/health", timeout=self._timeout) as answer:
                healthy, why = answer.status == 200, f"/health answered {answer.status}"
        except asyncio.TimeoutError:
            healthy, why = False, "/health timed out"
        except (ClientError, OSError) as exc:
            healthy, why = False, one_line(f"/health failed: {exc or type(exc).__name__}")
        instance.set_health(healthy, why)
