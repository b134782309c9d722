"""A call that meets a SIGKILLed server returns at once with a server fault, not after its
timeout, over every transport: killed before the call, while the call waits for an answer,
and while the call's bytes are on their way."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from helpers import until
from serve import TRANSPORTS, ServeProcess

from kvbridge.store import StoreClient, prefix_hashes
from kvbridge.store.client import SERVER_FAULTS

TIMEOUT = 30.0
"""The clients' timeout: a call that waited it out would fail the bound below."""
NOTICED = 3.0
"""A call returns within this of the kill (measured: 0.002-0.15 s; the bound leaves room for
a loaded machine, and is a tenth of the timeout)."""
BLOCK = 1 << 20
BLOCKS = 256


@pytest.fixture(params=TRANSPORTS)
def served(request: pytest.FixtureRequest) -> Iterator[tuple[ServeProcess, StoreClient]]:
    offered = "nixl" if request.param == "nixl" else "tcp,ucx"  # one UCX build a process
    server = ServeProcess("--host-capacity", "1GiB", "--transports", offered)
    client = StoreClient(
        server.address,
        block_bytes=BLOCK,
        namespace="death",
        timeout=TIMEOUT,
        transports=request.param,
    )
    try:
        yield server, client
    finally:
        client.close()
        server.kill()


def _returns_soon(call: Callable[[], object], kill: Callable[[], None]) -> float:
    """Run ``call`` on a thread, ``kill`` the server once it is under way; how long after
    the kill the call returned (it must raise a server fault)."""
    outcome: list[BaseException | None] = []
    started = threading.Event()

    def run() -> None:
        started.set()
        try:
            call()
            outcome.append(None)
        except BaseException as exc:  # judged below
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    started.wait()
    kill()
    killed = time.monotonic()
    thread.join(TIMEOUT + 5)
    took = time.monotonic() - killed
    assert outcome and isinstance(outcome[0], SERVER_FAULTS), outcome
    return took


def test_a_call_after_the_kill(served: tuple[ServeProcess, StoreClient]) -> None:
    server, client = served
    keys = prefix_hashes(range(16 * 8), 16)
    client.put(keys, np.ones(8 * BLOCK, np.uint8))
    server.kill()
    started = time.monotonic()
    with pytest.raises(SERVER_FAULTS):
        client.contains(keys)
    assert time.monotonic() - started < NOTICED


@pytest.mark.slow
def test_a_call_waiting_for_its_answer(served: tuple[ServeProcess, StoreClient]) -> None:
    """The server is frozen (SIGSTOP) so that the lookup surely waits, then killed."""
    server, client = served
    keys = prefix_hashes(range(16 * 8), 16)
    client.put(keys, np.ones(8 * BLOCK, np.uint8))
    server.freeze()  # every thread stopped: none answers the lookup
    took = _returns_soon(lambda: client.match_prefix(keys), server.kill)
    assert took < NOTICED


@pytest.mark.slow
def test_a_get_whose_bytes_are_on_their_way(served: tuple[ServeProcess, StoreClient]) -> None:
    """The kill lands once the first bytes of a 256 MiB get are in: its pin is done, its
    bytes stream in (over UCX the data stream reports nothing, the control connection's
    drop is what ends it)."""
    server, client = served
    keys = prefix_hashes(range(16 * BLOCKS), 16)
    client.put(keys, np.ones(BLOCKS * BLOCK, np.uint8))
    out = np.zeros(BLOCKS * BLOCK, np.uint8)

    def kill_once_landing() -> None:
        until(lambda: bool(out[::BLOCK].any()), "the first bytes landed", pause=0.0005)
        server.kill()

    assert _returns_soon(lambda: client.get(keys, out), kill_once_landing) < NOTICED
