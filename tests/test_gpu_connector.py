"""The connector core moving a KV cache that lives in CUDA memory, as vLLM 0.32's GPU worker
hands it over (``tests/vllm_views.py``: one allocation for every layer, a ``[B, H, N, C]``
view of it per layer in a ``KVCacheLayout``), through a ``kvbridge serve`` on the same
machine: LBNHC (what FlashAttention gets on an H100 or H200), LBHNC and the
block-outermost BLHNC, bf16 and fp8, 1 and 8 KV heads, and MLA's latent; staged through
pinned host memory (any transport) and directly over UCX (where ucxx and cupy take CUDA
memory).

The engine runs each step on a thread of its own with a CUDA stream of its own current
(not the default stream), as vLLM's forward does, and its work on the cache lands late
(queued behind ``torch.cuda._sleep``). A save made at ``wait_for_save`` (at once, or queued
for the saver thread) must move the bytes that step's forward wrote: a fresh connector
loads them into a zeroed cache, byte for byte. A load must land after the engine's earlier
work on its blocks (vLLM zeroes the blocks it hands out): the engine's stream then reads
the loaded bytes, and zeros everywhere else. A move that does not wait for the engine's
stream shows as wrong bytes; the sleep only makes that window wide, and a connector that
orders its moves passes whatever its length. A server SIGKILLed under the connector costs
misses, never an exception into the engine. Runs where torch sees a GPU
(``benches/gpu_check.sh``); skips elsewhere, saying why."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from serve import ServeProcess
from vllm_views import KVCache, Spec, allocate, blocks_of

from kvbridge.bindings import ConnectorConfig, ConnectorCore, Identity, PagedKV, SaveJob
from kvbridge.bindings.core import tensor_pages


def _cuda() -> Any:
    if importlib.util.find_spec("torch") is None:
        return None
    import torch  # noqa: PLC0415

    return torch if torch.cuda.is_available() else None


torch = _cuda()
pytestmark = pytest.mark.skipif(torch is None, reason="torch with a CUDA GPU is not available")

BLOCKS, TOKENS, LAYERS, HEAD_DIM, LATENT = 64, 16, 4, 128, 576
SAVED = list(range(30))
LOADED = list(range(63, 33, -1))  # 30 other blocks, in another order
UNTOUCHED = [b for b in range(BLOCKS) if b not in LOADED]
LATE = 1 << 28
"""GPU clock cycles the engine's stream sleeps before its work on the cache: about 0.14 s
at the H200's 1.98 GHz boost clock (longer at lower clocks), far more than a move takes to
start."""
STAGING = "16MiB"
"""Pinned host memory a staged connector takes: its largest move (30 blocks of 256 KiB) in
one chunk, without pinning the default 256 MiB twice a test."""
REQUEST = "req-1"
T = TypeVar("T")


@dataclass(frozen=True)
class Case:
    """A KV cache geometry: vLLM's layout, KV heads (``mla``: MLA's one latent head), dtype."""

    layout: str
    heads: int
    dtype: str
    mla: bool = False

    def __str__(self) -> str:
        kind = "mla" if self.mla else f"{self.heads}h"
        return f"{self.layout}-{kind}-{self.dtype}"

    def spec(self) -> Spec:
        size = int(torch.empty(0, dtype=self.torch_dtype()).element_size())
        if self.mla:
            return Spec.mla(BLOCKS, TOKENS, LATENT, size)
        return Spec.attention(BLOCKS, self.heads, TOKENS, HEAD_DIM, size)

    def torch_dtype(self) -> Any:
        return getattr(torch, {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}[self.dtype])


CASES = [
    *(
        Case(layout, heads, dtype)
        for layout in ("LBNHC", "LBHNC", "BLHNC")
        for heads in (8, 1)
        for dtype in ("bf16", "fp8")
    ),
    *(
        Case(layout, 1, dtype, mla=True)
        for layout in ("LBNHC", "BLHNC")
        for dtype in ("bf16", "fp8")
    ),
]
PATHS = {"staged": "tcp", "direct": "ucx"}


def _direct_ok() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("ucxx", "cupy"))


def _skip_unless_possible(path: str) -> None:
    if path == "direct" and not _direct_ok():
        pytest.skip("ucxx and cupy are needed to move CUDA memory directly")


@pytest.fixture(scope="module", params=list(PATHS))
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, ServeProcess]]:
    """One server per path for the module; every test has a namespace of its own (its
    identity names the test), one of 64 that each hold 64 MiB, so none is reclaimed."""
    path = str(request.param)
    _skip_unless_possible(path)
    server = ServeProcess(
        *("--host-capacity", "4GiB", "--max-namespaces", "64", "--transports", PATHS[path])
    )
    try:
        yield path, server
    finally:
        server.kill()


@pytest.fixture(params=list(PATHS))
def own_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, ServeProcess]]:
    """A server of the test's own, for a test that kills it."""
    path = str(request.param)
    _skip_unless_possible(path)
    server = ServeProcess("--host-capacity", "1GiB", "--transports", PATHS[path])
    try:
        yield path, server
    finally:
        server.kill()


class Engine:
    """The engine's side of a step as vLLM's worker runs it: a thread of its own, with a
    CUDA stream of its own current there (not the default stream)."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()

    def step(self, work: Callable[[], T]) -> T:
        """Run ``work`` on the engine's thread and stream; its result, or its exception."""

        def run() -> T:
            with torch.cuda.stream(self.stream):
                return work()

        with ThreadPoolExecutor(1, thread_name_prefix="engine") as thread:
            return thread.submit(run).result()


def _late(work: Callable[[], None]) -> None:
    """Queue ``work`` on the current stream behind a sleep of ``LATE`` cycles."""
    torch.cuda._sleep(LATE)
    work()


def _random(cache: KVCache, seed: int) -> Any:
    """Random bytes the size of the cache's allocation, on its device."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(
        -128, 128, cache.raw.shape, dtype=torch.int8, device="cuda", generator=generator
    )


def _cache(case: Case) -> KVCache:
    return allocate(case.layout, case.spec(), LAYERS, case.torch_dtype(), device="cuda")


def _core(
    server: ServeProcess, cache: KVCache, path: str, name: str, *, saves: bool = False
) -> ConnectorCore:
    """A connector core on ``cache``'s pages (``tensor_pages`` of each layer's view, as the
    worker side registers them), connected to ``server``."""
    first = next(iter(cache.layers.values()))
    page = cache.spec.page
    identity = Identity("gpu", "m", str(first.dtype), name, TOKENS, page * LAYERS, "tp0/1")
    config = ConnectorConfig.from_extra(
        {"server": server.address, "transports": PATHS[path], "staging_bytes": STAGING}
    )
    core = ConnectorCore(config, identity, saves=saves)
    try:
        pages = tuple(p for n, t in cache.layers.items() for p in tensor_pages(n, t, page))
        core.attach(PagedKV(pages, f"{cache.layout}/{first.dtype}"))
        assert core.wait_ready(10), "the connector reached its server"
    except BaseException:
        core.close()
        raise
    return core


def _wait_for_save(core: ConnectorCore, keys: Sequence[Any], ids: list[int], how: str) -> None:
    """What the worker side does at vLLM's ``wait_for_save``, on the engine's thread: save
    the blocks now (a sliding window's), or queue them for the saver thread (any other)."""
    mark = core.mark()  # the worker side's: the engine's stream, on the engine's thread
    if how == "now":
        assert core.save(keys, ids, after=mark)
    else:
        core.save_later([SaveJob(REQUEST, tuple(keys), tuple(ids), 0, mark)])


@pytest.mark.parametrize("how", ["now", "queued"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_save_moves_what_the_engine_stream_wrote(
    served: tuple[str, ServeProcess], case: Case, how: str, request: pytest.FixtureRequest
) -> None:
    path, server = served
    source, target = _cache(case), _cache(case)
    written = _random(source, seed=1)
    torch.cuda.synchronize()
    saver = _core(server, source, path, request.node.name, saves=True)
    try:
        loader = _core(server, target, path, request.node.name)
    except BaseException:
        saver.close()
        raise
    try:
        keys = saver.keys(list(range(TOKENS * len(SAVED))))

        def forward_then_wait_for_save() -> None:
            _late(lambda: source.raw.copy_(written))  # the forward's writes, landing late
            _wait_for_save(saver, keys, SAVED, how)

        Engine().step(forward_then_wait_for_save)
        assert saver.flush([REQUEST])
        assert saver.stats.totals()["blocks_not_saved"] == 0
        torch.cuda.synchronize()
        expected = blocks_of(source, SAVED)
        assert expected.any(), "the forward wrote the blocks"
        assert loader.load(keys, LOADED)
        torch.cuda.synchronize()
        assert torch.equal(blocks_of(target, LOADED), expected)
    finally:
        saver.close()
        loader.close()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_a_load_lands_after_the_engine_streams_earlier_work(
    served: tuple[str, ServeProcess], case: Case, request: pytest.FixtureRequest
) -> None:
    path, server = served
    source, target = _cache(case), _cache(case)
    source.raw.copy_(_random(source, seed=2))
    target.raw.copy_(_random(target, seed=3))  # what the blocks held before vLLM took them
    torch.cuda.synchronize()
    saver = _core(server, source, path, request.node.name)
    try:
        loader = _core(server, target, path, request.node.name)
    except BaseException:
        saver.close()
        raise
    try:
        keys = saver.keys(list(range(TOKENS * len(SAVED))))
        assert saver.save(keys, SAVED)
        expected = blocks_of(source, SAVED)

        def zero_then_start_load() -> tuple[bool, Any, Any]:
            _late(target.raw.zero_)  # vLLM zeroes the blocks it hands out, on its stream
            loaded = loader.load(keys, LOADED, after=loader.mark())
            # what the engine's next kernels read, on its stream
            return loaded, blocks_of(target, LOADED), blocks_of(target, UNTOUCHED)

        loaded, got, rest = Engine().step(zero_then_start_load)
        assert loaded
        assert torch.equal(got, expected)
        assert not rest.any(), "the engine's zeros, everywhere the load did not write"
    finally:
        saver.close()
        loader.close()


def test_a_server_killed_under_cuda_pages_is_misses_not_exceptions(
    own_server: tuple[str, ServeProcess],
) -> None:
    path, server = own_server
    cache = _cache(Case("LBHNC", 8, "bf16"))  # a layout every connector version takes
    cache.raw.copy_(_random(cache, seed=4))
    torch.cuda.synchronize()
    core = _core(server, cache, path, "killed")
    try:
        keys = core.keys(list(range(TOKENS * 8)))
        assert core.save(keys, list(range(8)))
        server.kill()
        assert not core.load(keys, list(range(8, 16)))  # a miss: the engine recomputes
        assert not core.save(core.keys(list(range(5000, 5000 + TOKENS))), [20])
        assert core.stats.totals()["store_faults"] >= 1
    finally:
        core.close()
