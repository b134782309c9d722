"""The backend under SGLang's own controller code (prefetch and backup, both interfaces),
and what a killed, a frozen and a restarted ``kvbridge serve`` do to it: misses and
``False``, never an exception through the controller, never a wait past the timeout."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
import torch
from controller import CC, Controller
from helpers import free_port
from host_pools import MHAPool, MLAPool
from serve import ServeProcess
from test_sglang_backend import backend, names

import kvbridge.bindings.core._core as core_module

T = TypeVar("T")

PAGES = 300
"""More than two of SGLang's storage batches (``STORAGE_BATCH_SIZE`` = 128 pages)."""


@pytest.fixture
def served() -> Iterator[ServeProcess]:
    proc = ServeProcess("--host-capacity", "64MiB", "--lease-ttl", "30")
    yield proc
    proc.kill()


@pytest.fixture
def controller_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.WARNING, logger=CC)
    return caplog


def within(seconds: float, call: Callable[[], T]) -> T:
    """``call()``'s result; fails if it has not returned after ``seconds`` (a hang)."""
    out: list[T] = []
    worker = threading.Thread(target=lambda: out.append(call()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still waiting after {seconds} s"
    assert out, "raised (see the thread's exception above)"
    return out[0]


def _reads_back(source: Any, target: Any, extra: dict[str, Any], keys: list[str]) -> None:
    """Another backend prefetches the 4 pages ``source`` backed up from slots 0-3 into
    slots 8-11 of ``target``, byte for byte."""
    reader = Controller(backend(target, extra), target)
    try:
        assert reader.prefetch(keys, target.slots(8, 9, 10, 11)) == 4
        assert target.page_bytes(8 * 4) == source.page_bytes(0)
    finally:
        reader.storage_backend.close()


def pools(make: Callable[[], Any]) -> tuple[Any, Any]:
    source, target = make(), make()
    source.fill(seed=11)
    return source, target


@pytest.mark.parametrize("zero_copy", [1, 0], ids=["zero-copy", "copying"])
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: MHAPool(pages=PAGES + 4), id="mha"),
        pytest.param(lambda: MLAPool("layer_first", pages=PAGES + 4), id="mla"),
    ],
)
def test_sglang_backs_up_and_prefetches_through_it(
    served: ServeProcess, controller_log: pytest.LogCaptureFixture, make: Any, zero_copy: int
) -> None:
    source, target = pools(make)
    extra = {"server": served.address, "interface_v1": zero_copy}
    writer = Controller(backend(source, extra), source)
    reader = Controller(backend(target, extra), target)
    keys = names(PAGES)
    order = list(range(PAGES))
    assert writer.backup(keys, source.slots(*order)) == PAGES
    assert reader.storage_backend.batch_exists(keys) == PAGES
    placed = order[::-1]  # other slots than the writer's
    assert reader.prefetch(keys, target.slots(*placed)) == PAGES
    ps = source.page_size
    assert all(
        target.page_bytes(dst * ps) == source.page_bytes(src * ps)
        for src, dst in zip(order, placed, strict=True)
    )
    assert writer.backup(keys, source.slots(*order)) == PAGES  # again: moves nothing
    assert (
        writer.storage_backend.stats()["bytes_saved"]
        == PAGES * source.get_dummy_flat_data_page().nbytes
    )
    assert not controller_log.records
    for ctl in (writer, reader):
        ctl.storage_backend.close()


@pytest.mark.parametrize("zero_copy", [1, 0], ids=["zero-copy", "copying"])
def test_a_killed_server_is_misses_and_failed_writes(
    served: ServeProcess, controller_log: pytest.LogCaptureFixture, zero_copy: int
) -> None:
    source, target = pools(lambda: MHAPool(pages=16))
    extra = {"server": served.address, "interface_v1": zero_copy, "timeout": 2}
    writer = Controller(backend(source, extra), source)
    reader = Controller(backend(target, extra), target)
    keys = names(8)
    assert writer.backup(keys[:4], source.slots(0, 1, 2, 3)) == 4
    served.kill()
    store = reader.storage_backend
    assert within(30, lambda: store.batch_exists(keys)) == 0
    assert within(30, lambda: reader.prefetch(keys[:4], target.slots(4, 5, 6, 7))) == 0
    assert within(30, lambda: writer.backup(keys[4:], source.slots(4, 5, 6, 7))) == 0
    assert not any(target.kv_buffer.view(-1).view(torch.uint8))  # no byte landed
    assert within(30, store.clear) is False
    if zero_copy:
        assert within(30, lambda: store.batch_get_v1(keys[:2], target.slots(0, 1))) == [False] * 2
        assert within(30, lambda: store.batch_set_v1(keys[:2], target.slots(0, 1))) == [False] * 2
    else:
        assert within(30, lambda: store.get(keys[0])) is None
        assert within(30, lambda: store.set(keys[0], source.get_data_page(0))) is False
    # SGLang logged what it logs for a miss and a failed write; nothing raised through it
    assert all(record.exc_info is None for record in controller_log.records)
    assert any("failed" in record.getMessage() for record in controller_log.records)
    writer.storage_backend.close()
    store.close()


def test_a_frozen_server_costs_one_timeout_then_calls_skip_it(
    served: ServeProcess, controller_log: pytest.LogCaptureFixture
) -> None:
    """SIGSTOP: the server holds its connections but answers nothing. A call waits for
    ``timeout`` at most, then calls are misses at once until the pause is over."""
    source, target = pools(lambda: MHAPool(pages=16))
    extra = {"server": served.address, "interface_v1": 1, "timeout": 1}
    writer = Controller(backend(source, extra), source)
    reader = Controller(backend(target, extra), target)
    keys = names(4)
    assert writer.backup(keys, source.slots(0, 1, 2, 3)) == 4
    served.proc.send_signal(signal.SIGSTOP)
    try:
        assert within(20, lambda: reader.prefetch(keys, target.slots(4, 5, 6, 7))) == 0
        assert within(20, lambda: reader.storage_backend.batch_exists(keys)) == 0
        assert within(20, lambda: writer.backup(names(4, "q"), source.slots(4, 5, 6, 7))) == 0
    finally:
        served.proc.send_signal(signal.SIGCONT)
    assert not any(target.kv_buffer.view(-1).view(torch.uint8))  # no byte landed
    assert all(record.exc_info is None for record in controller_log.records)
    for ctl in (writer, reader):
        ctl.storage_backend.close()


def test_a_restarted_server_is_used_again_after_the_pause(
    served: ServeProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(core_module, "_RETRY_AFTER_S", 0.2)
    source, target = pools(lambda: MHAPool(pages=16))
    port = served.address.rsplit(":", 1)[1]
    extra = {"server": served.address, "interface_v1": 1, "timeout": 2}
    writer = Controller(backend(source, extra), source)
    keys = names(4)
    served.kill()
    assert writer.backup(keys, source.slots(0, 1, 2, 3)) == 0
    again = ServeProcess("--port", port, "--host-capacity", "64MiB")
    try:
        stored = 0
        for _ in range(50):  # the first call after the pause reconnects
            stored = writer.backup(keys, source.slots(0, 1, 2, 3))
            if stored:
                break
            threading.Event().wait(0.1)
        assert stored == 4
        _reads_back(source, target, extra, keys)
    finally:
        writer.storage_backend.close()
        again.kill()


def test_sglang_starts_while_the_server_is_down_and_uses_it_once_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(core_module, "_RETRY_AFTER_S", 0.5)
    port = free_port()
    source, target = pools(lambda: MHAPool(pages=16))
    extra = {"server": f"127.0.0.1:{port}", "interface_v1": 1, "timeout": 2}
    writer = Controller(backend(source, extra), source)  # registers the pool: no error
    keys = names(4)
    assert writer.backup(keys, source.slots(0, 1, 2, 3)) == 0
    late = ServeProcess("--port", str(port), "--host-capacity", "64MiB")
    try:
        time.sleep(0.6)  # the pause after the failed connect
        assert writer.backup(keys, source.slots(0, 1, 2, 3)) == 4
        _reads_back(source, target, extra, keys)
    finally:
        writer.storage_backend.close()
        late.kill()


def test_close_while_sglang_threads_call_is_misses_not_errors(served: ServeProcess) -> None:
    """SGLang's prefetch, I/O and backup threads keep calling while the backend closes
    (a detach): each call returns, none raises."""
    pool = MHAPool(pages=32)
    pool.fill(seed=14)
    made = backend(pool, {"server": served.address, "interface_v1": 1})
    keys = names(8)
    assert made.batch_set_v1(keys, pool.slots(*range(8))) == [True] * 8
    errors: list[BaseException] = []
    stop = threading.Event()
    calls = [
        lambda: made.batch_exists(keys),
        lambda: made.batch_get_v1(keys, pool.slots(*range(8, 16))),
        lambda: made.batch_set_v1(names(8, "q"), pool.slots(*range(16, 24))),
    ]

    def loop(call: Callable[[], object]) -> None:
        while not stop.is_set():
            try:
                call()
            except BaseException as exc:  # what would reach SGLang's controller
                errors.append(exc)
                return

    threads = [threading.Thread(target=loop, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    made.close()
    time.sleep(0.3)
    stop.set()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    assert made.batch_exists(keys) == 0
    assert made.batch_get_v1(keys, pool.slots(*range(8))) == [False] * 8


def test_an_in_process_store_needs_no_server(controller_log: pytest.LogCaptureFixture) -> None:
    """Without ``server`` the rank keeps its pages in a store of its own."""
    pool = MHAPool(pages=16)
    pool.fill(seed=12)
    ctl = Controller(backend(pool, {"interface_v1": 1, "host_capacity": "4MiB"}), pool)
    keys = names(6)
    assert ctl.backup(keys, pool.slots(*range(6))) == 6
    assert ctl.prefetch(keys, pool.slots(*range(8, 14))) == 6
    assert pool.page_bytes(8 * 4) == pool.page_bytes(0)
    assert pool.page_bytes(13 * 4) == pool.page_bytes(5 * 4)
    assert not controller_log.records
    ctl.storage_backend.close()
