"""The connector core moving a KV cache that lives in CUDA memory, through a ``kvbridge
serve`` on the same machine: vLLM's FlashAttention layout ``(2, num_blocks, block_size,
kv_heads, head_dim)`` and the MLA layout ``(num_blocks, block_size, head_size)``, bf16 and
fp8, staged through pinned host memory (any transport) and directly over UCX (where ucxx
and cupy take CUDA memory): byte-exact, untouched blocks unchanged; a server SIGKILLed under
it costs misses, never an exception into the engine. Runs where torch sees a GPU
(``benches/gpu_check.sh``); skips elsewhere, saying why."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest
from serve import ServeProcess

from kvbridge.bindings import ConnectorConfig, ConnectorCore, Identity, PagedKV
from kvbridge.bindings.core import tensor_pages


def _cuda() -> Any:
    if importlib.util.find_spec("torch") is None:
        return None
    import torch  # noqa: PLC0415

    return torch if torch.cuda.is_available() else None


torch = _cuda()
pytestmark = pytest.mark.skipif(torch is None, reason="torch with a CUDA GPU is not available")

BLOCKS, TOKENS, LAYERS = 64, 16, 4
SHAPES = {"flash": (2, BLOCKS, TOKENS, 8, 128), "mla": (BLOCKS, TOKENS, 576)}
DTYPES = ("bfloat16", "float8_e4m3fn")


def _direct_ok() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("ucxx", "cupy"))


PATHS = {
    "staged": {"transports": "tcp"},
    "direct": {"transports": "ucx"},
}


@pytest.fixture(params=list(PATHS))
def path(request: pytest.FixtureRequest) -> str:
    if request.param == "direct" and not _direct_ok():
        pytest.skip("ucxx and cupy are needed to move CUDA memory directly")
    return str(request.param)


@pytest.fixture
def server(path: str) -> Iterator[ServeProcess]:
    transports = "ucx" if path == "direct" else "tcp"
    served = ServeProcess("--host-capacity", "1GiB", "--transports", transports)
    try:
        yield served
    finally:
        served.kill()


def _caches(shape: tuple[int, ...], dtype: str, seed: int) -> dict[str, Any]:
    kind = getattr(torch, dtype)
    size = torch.tensor([], dtype=kind).element_size()
    generator = torch.Generator(device="cuda").manual_seed(seed)
    raw = (*shape[:-1], shape[-1] * size)
    return {
        f"layer.{i}": torch.randint(
            0, 256, raw, dtype=torch.uint8, device="cuda", generator=generator
        ).view(kind)
        for i in range(LAYERS)
    }


def _core(
    server: ServeProcess, caches: dict[str, Any], path: str, name: str
) -> tuple[ConnectorCore, int]:
    first = next(iter(caches.values()))
    raw = first.view(torch.uint8)
    page = 2 * raw[0, 0].numel() if raw.dim() == 5 else raw[0].numel()
    identity = Identity("gpu", "m", str(first.dtype), name, TOKENS, page * LAYERS, "tp0/1")
    config = ConnectorConfig.from_extra({"server": server.address, **PATHS[path]})
    core = ConnectorCore(config, identity)
    pages = tuple(p for n, t in caches.items() for p in tensor_pages(n, t, page))
    core.attach(PagedKV(pages, name))
    return core, page


def _blocks(caches: dict[str, Any], ids: list[int]) -> list[bytes]:
    out = []
    for b in ids:
        parts = []
        for tensor in caches.values():
            raw = tensor.view(torch.uint8)
            parts += [raw[0, b], raw[1, b]] if raw.dim() == 5 else [raw[b]]
        out.append(b"".join(p.cpu().contiguous().numpy().tobytes() for p in parts))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", list(SHAPES))
def test_cuda_pages_round_trip_byte_for_byte(
    server: ServeProcess, path: str, layout: str, dtype: str
) -> None:
    caches = _caches(SHAPES[layout], dtype, seed=1)
    core, _ = _core(server, caches, path, f"{layout}-{dtype}")
    try:
        keys = core.keys(list(range(TOKENS * 30)))
        saved = list(range(30))
        loaded = list(range(63, 33, -1))  # 30 other blocks, in another order
        expected = _blocks(caches, saved)
        untouched = [b for b in range(BLOCKS) if b not in loaded]
        before = _blocks(caches, untouched)
        assert core.save(keys, saved)
        assert core.load(keys, loaded)
        torch.cuda.synchronize()
        assert _blocks(caches, loaded) == expected
        assert _blocks(caches, untouched) == before
    finally:
        core.close()


def test_a_server_killed_under_cuda_pages_is_misses_not_exceptions(
    server: ServeProcess, path: str
) -> None:
    caches = _caches(SHAPES["flash"], "bfloat16", seed=2)
    core, _ = _core(server, caches, path, "killed")
    try:
        keys = core.keys(list(range(TOKENS * 8)))
        assert core.save(keys, list(range(8)))
        server.kill()
        assert not core.load(keys, list(range(8, 16)))  # a miss: the engine recomputes
        assert not core.save(core.keys(list(range(5000, 5000 + TOKENS))), [20])
        assert core.stats.totals()["store_faults"] >= 1
    finally:
        core.close()
