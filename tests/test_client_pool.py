"""ClientPool, the clients of a connector and of a cluster client: one caller per client at a
time, a client whose server failed is closed and replaced, a caller queued behind a call to
a frozen server makes no call of its own to it, and no ``zmq`` error escapes a client."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import pytest
import zmq
from helpers import keys, payloads, until
from serve import ServeProcess

from kvbridge.store import StoreClient, StoreError
from kvbridge.store.client import SERVER_FAULTS, ClientPool
from kvbridge.transfer import TransferEngine

BB = 64 << 10


@pytest.fixture
def server() -> Iterator[ServeProcess]:
    served = ServeProcess("--host-capacity", "16MiB")
    try:
        yield served
    finally:
        served.proc.send_signal(signal.SIGCONT)
        served.kill()


def _pool(per_server: int = 1, timeout: float = 10.0) -> ClientPool:
    return ClientPool(per_server=per_server, block_bytes=BB, namespace="pool", timeout=timeout)


def test_a_client_that_met_a_fault_is_closed_and_the_next_lease_gets_a_new_one(
    server: ServeProcess,
) -> None:
    pool = _pool()
    try:
        with pool.lease(server.address) as (first, _):
            first.put(keys(0, 2), payloads(keys(0, 2), BB))
        with pytest.raises(ConnectionResetError), pool.lease(server.address) as (same, _):
            assert same is first  # one client per server: the same one, while it works
            raise ConnectionResetError("the link went down")  # a fault met inside a lease
        with pool.lease(server.address) as (fresh, _):
            assert fresh is not first
            assert fresh.match_prefix(keys(0, 2)) == 2
        with pytest.raises(StoreError):
            first.match_prefix(keys(0, 2))  # closed
    finally:
        pool.close()


def test_a_refusal_keeps_the_client(server: ServeProcess) -> None:
    pool = _pool()
    try:
        with pool.lease(server.address) as (first, _):
            pass
        with pytest.raises(StoreError), pool.lease(server.address) as (same, _):
            raise StoreError("refused")  # the server answered: nothing wrong with the link
        with pool.lease(server.address) as (again, _):
            assert again is first and same is first
    finally:
        pool.close()


def test_several_clients_per_server_serve_callers_at_once(server: ServeProcess) -> None:
    pool = _pool(per_server=2)
    inside, leave = threading.Event(), threading.Event()
    held: list[StoreClient] = []

    def holder() -> None:
        with pool.lease(server.address) as (client, _):
            held.append(client)
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert inside.wait(30)
        with pool.lease(server.address) as (other, _):  # not queued behind the holder
            assert other is not held[0]
            assert other.match_prefix(keys(0, 1)) == 0
    finally:
        leave.set()
        thread.join()
        pool.close()


@pytest.mark.slow
def test_a_caller_queued_behind_a_call_to_a_frozen_server_makes_no_call_of_its_own(
    server: ServeProcess,
) -> None:
    """The cluster failure this pool fixes: a reader waited for the client a writer was
    using on a killed member, then made its own call there and waited a second timeout."""
    pool = _pool(timeout=2.0)
    with pool.lease(server.address):
        pass  # connected while the server answered
    server.freeze()
    inside = threading.Event()
    outcomes: dict[str, BaseException | str] = {}

    def first() -> None:
        try:
            with pool.lease(server.address) as (client, _):
                inside.set()
                client.match_prefix(keys(0, 1))
        except BaseException as exc:
            outcomes["first"] = exc

    def queued() -> None:
        try:
            with pool.lease(server.address):
                outcomes["queued"] = "made a call"
        except BaseException as exc:
            outcomes["queued"] = exc

    threads = [threading.Thread(target=first), threading.Thread(target=queued)]
    threads[0].start()
    assert inside.wait(30)
    threads[1].start()
    for thread in threads:
        thread.join(60)
    try:
        assert isinstance(outcomes["first"], SERVER_FAULTS)
        assert isinstance(outcomes["queued"], SERVER_FAULTS), outcomes["queued"]
    finally:
        pool.close()


def test_no_zmq_error_escapes_a_client_whose_engine_closes_under_its_handshake(
    server: ServeProcess,
) -> None:
    """A client connecting (a first connection, or a reconnection after a restart) through
    an engine that another thread closes (shutdown): the connection fails with a transfer
    error, never a ``zmq.ZMQError`` (zmq ends every socket wait with ETERM when its context
    terminates)."""
    engine = TransferEngine()
    server.freeze()  # the handshake waits for an answer
    raised: list[BaseException] = []

    def connect() -> None:
        try:
            StoreClient(server.address, block_bytes=BB, namespace="pool", engine=engine)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=connect)
    thread.start()
    port = int(server.address.rsplit(":", 1)[1])
    until(lambda: _connections_to(port) > 0, "the handshake under way")
    engine.close()
    thread.join(60)
    assert not thread.is_alive()
    assert len(raised) == 1
    assert not isinstance(raised[0], zmq.ZMQError), repr(raised[0])
    assert isinstance(raised[0], SERVER_FAULTS), repr(raised[0])


def _connections_to(port: int) -> int:
    """Established TCP connections to ``port`` on this machine (the kernel accepts them
    for a stopped server too)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            next(rows)
            for row in rows:
                remote, state = row.split()[2:4]
                if state == "01" and int(remote.rsplit(":", 1)[1], 16) == port:
                    count += 1
    return count


def test_a_closed_pool_lends_nothing(server: ServeProcess) -> None:
    pool = _pool()
    pool.close()
    with pytest.raises(StoreError), pool.lease(server.address):
        pass
