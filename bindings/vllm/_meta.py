"""What the scheduler side of the vLLM connector tells its workers each step, and what
they tell it back. Plain picklable data (vLLM ships it between processes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from ...store import BlockKey


@dataclass(frozen=True)
class Transfer:
    """Blocks of one request to load or save: ``keys[i]`` is engine block ``block_ids[i]``,
    and the prompt's block ``start + i`` (a cluster keeps a prompt's first blocks twice)."""

    request: str
    keys: tuple[BlockKey, ...]
    block_ids: tuple[int, ...]
    start: int = 0
    now: bool = False
    """A save to run before the step ends (a sliding window's blocks: vLLM frees them once
    they leave the window and may hand them to another request in the next step)."""
    parent: BlockKey | None = None
    """A save: the key of the block before ``keys[0]`` in its group (``None`` at the
    prompt's start)."""
    token_ids: tuple[int, ...] = ()
    """A save: the token ids of its blocks, which the server's events carry for KV-aware
    routers (``docs/EVENTS.md``)."""


@dataclass
class StepMeta(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[Transfer] = field(default_factory=list)
    """Run before this step's forward (their tokens are not computed by it)."""
    async_loads: list[Transfer] = field(default_factory=list)
    """Run on the worker's loader thread; the request waits (``WAITING_FOR_REMOTE_KVS``)
    until the worker reports it in ``finished_recving``."""
    saves: list[Transfer] = field(default_factory=list)
    """Blocks that became full in this step: saved after its forward."""
    preempted: list[str] = field(default_factory=list)
    """Requests whose blocks this step may overwrite: their saves must end first."""


@dataclass
class Handshake(KVConnectorHandshakeMetadata):  # type: ignore[misc]
    """Worker to scheduler, once: the cache server the worker runs for this engine."""

    address: str
    secret: bytes

    def __repr__(self) -> str:
        return f"Handshake(address={self.address!r})"  # never the secret


@dataclass
class WorkerReport(KVConnectorWorkerMetadata):  # type: ignore[misc]
    failed: set[BlockKey] = field(default_factory=set)
    """Keys whose load failed: the scheduler stops advertising them for a while."""
    unsaved: set[str] = field(default_factory=set)
    """Requests whose saves of a step were dropped: a load of that step failed, so what
    its forward computed may rest on wrong KV (vLLM recomputes it; it must not be saved)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, WorkerReport)
        return WorkerReport(self.failed | other.failed, self.unsaved | other.unsaved)


@dataclass
class KVBridgeStats(KVConnectorStats):  # type: ignore[misc]
    """The connector's counters for one interval (``kvbridge.bindings.ConnectorStats``)."""

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: value for name, value in self.data.items() if value}

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def is_empty(self) -> bool:
        return not any(self.data.values())
