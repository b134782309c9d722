"""An engine nobody closed (a client, a server's engine) is a leak, never a hang: when the
garbage collector finds it, whatever thread that happens in carries on.

pyzmq destroys a context that is collected unclosed, and an engine's context, its sockets
and the engine are one reference cycle: by the time the context's finalizer runs the
collector has cleared its weak references to its sockets, so pyzmq closes none of them and
``term`` waits for ever. CI once hung so: a test left a client open, and a later collection
ran inside a thread being started, whose ``start`` then never returned."""

from __future__ import annotations

import gc
import threading
import warnings
from collections.abc import Iterator

import pytest
from helpers import keys, payloads, until

from kvbridge.store import CacheServer, ServerConfig, StoreClient
from kvbridge.transfer import TransferEngine

BB = 4096


def _collect_aside(seconds: float) -> tuple[bool, list[str]]:
    """A garbage collection in a thread of its own: whether it ended within ``seconds``
    (a hung one stays behind, a daemon), and the resource warnings it raised."""
    seen: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        collector = threading.Thread(target=gc.collect, name="test-collector", daemon=True)
        collector.start()
        collector.join(seconds)
        seen = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    return not collector.is_alive(), seen


@pytest.fixture
def no_automatic_collection() -> Iterator[None]:
    """Collections only where the test makes them (an automatic one could run the leak's
    finalizers on the test's own thread)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _wait_until_settled(engine: TransferEngine) -> None:
    """Until no stream of ``engine`` runs and no deadline of it is armed: then nothing but
    the engine's own reference cycle holds it."""

    def settled() -> bool:
        stats = engine.stats()
        return stats["deadlines"] == 0 and all(peer["closed"] for peer in stats["peers"])

    until(settled, "the unclosed engine's streams and deadlines to end")


@pytest.mark.usefixtures("no_automatic_collection")
def test_a_client_nobody_closed_is_collected_without_hanging() -> None:
    with CacheServer(ServerConfig(port=0, host_capacity=8 << 20)) as server:
        client = StoreClient(server.address, block_bytes=BB, namespace="left", timeout=0.5)
        ks = keys(0, 4)
        assert all(client.put(ks, payloads(ks, BB)))  # its control and data sockets used
    # The server is gone (as at the end of a test): the client's streams end, and the
    # deadlines of its calls pass.
    _wait_until_settled(client.engine)
    del client
    ended, seen = _collect_aside(20)
    assert ended, "a collection of the unclosed client hung"
    assert any("was not terminated" in message for message in seen), seen
