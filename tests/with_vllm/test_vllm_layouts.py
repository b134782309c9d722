"""The vLLM worker side takes the KV cache layouts of vLLM's GPU backends, here on CPU
tensors of the same shapes (the bytes move the same way; the GPU run is
``benches/gpu_check.sh``): FlashAttention's ``(2, num_blocks, block_size, kv_heads,
head_dim)`` per layer (K and V first: two pages a layer) and MLA's ``(num_blocks,
block_size, head_size)``, bf16 and fp8, directly and staged. A layer kvbridge cannot move is
a ConfigError naming it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvbridge.bindings import ConnectorConfig, ConnectorCore, Identity
from kvbridge.bindings.vllm._worker import WorkerSide
from kvbridge.store import CacheServer, ConfigError, ServerConfig

BLOCKS, TOKENS, LAYERS = 12, 16, 3
SHAPES = {
    "flash": (2, BLOCKS, TOKENS, 2, 64),  # K and V first
    "mla": (BLOCKS, TOKENS, 96),  # one latent page a block
}
DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
PATHS = {"direct": {}, "staged": {"staging": "always", "staging_bytes": "64KiB"}}


@pytest.fixture(scope="module")
def server() -> Iterator[CacheServer]:
    with CacheServer(ServerConfig(port=0, host_capacity=64 << 20)) as srv:
        yield srv


def _caches(shape: tuple[int, ...], dtype: Any, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    size = torch.tensor([], dtype=dtype).element_size()
    raw = (*shape[:-1], shape[-1] * size)  # random bytes, viewed as ``dtype`` of ``shape``
    return {
        f"model.layers.{i}.self_attn": torch.randint(
            0, 256, raw, dtype=torch.uint8, generator=generator
        ).view(dtype)
        for i in range(LAYERS)
    }


def _side(
    server: CacheServer, shape: tuple[int, ...], dtype: Any, extra: dict[str, Any]
) -> tuple[WorkerSide, ConnectorCore]:
    size = torch.tensor([], dtype=dtype).element_size()
    per_block = shape[-3] * shape[-2] * shape[-1] * size if len(shape) == 5 else 0
    page = 2 * per_block if len(shape) == 5 else shape[1] * shape[2] * size
    identity = Identity(
        engine="test",
        model="m",
        dtype=str(dtype),
        layout=f"test/{shape}",
        block_tokens=TOKENS,
        block_bytes=page * LAYERS,
        shard="tp0/1",
    )
    config = ConnectorConfig.from_extra({"server": server.address, **extra})
    core = ConnectorCore(config, identity, saves=True)
    return WorkerSide(core), core


def _blocks(caches: dict[str, torch.Tensor], ids: list[int], kv_first: bool) -> list[bytes]:
    """Each block's bytes across every layer (and K, V), as the engine holds them."""
    out = []
    for b in ids:
        parts = []
        for tensor in caches.values():
            raw = tensor.view(torch.uint8)
            parts += [raw[0, b], raw[1, b]] if kv_first else [raw[b]]
        out.append(b"".join(p.contiguous().numpy().tobytes() for p in parts))
    return out


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("layout", list(SHAPES))
def test_pages_of_gpu_layouts_round_trip_byte_for_byte(
    server: CacheServer, layout: str, dtype: str, path: str
) -> None:
    shape, kind = SHAPES[layout], DTYPES[dtype]
    caches = _caches(shape, kind, seed=1)
    extra = {**PATHS[path], "namespace": f"{layout}-{dtype}-{path}"}
    side, core = _side(server, shape, kind, extra)
    try:
        side.register(caches)
        keys = core.keys(list(range(TOKENS * 4)))
        saved, loaded = [7, 1, 10, 4], [0, 2, 5, 11]
        expected = _blocks(caches, saved, layout == "flash")
        untouched = [b for b in range(BLOCKS) if b not in loaded]
        before = _blocks(caches, untouched, layout == "flash")
        assert core.save(keys, saved)
        assert core.load(keys, loaded)
        assert _blocks(caches, loaded, layout == "flash") == expected
        assert _blocks(caches, untouched, layout == "flash") == before
    finally:
        side.close()
        core.close()


def test_a_layer_on_a_device_kvbridge_cannot_move_is_a_config_error(server: CacheServer) -> None:
    shape = SHAPES["mla"]
    side, core = _side(server, shape, torch.bfloat16, {})
    caches = {"model.layers.0.self_attn": torch.empty(shape, dtype=torch.bfloat16, device="meta")}
    try:
        with pytest.raises(ConfigError, match=r"model\.layers\.0\.self_attn is on meta"):
            side.register(caches)
    finally:
        side.close()
        core.close()


def test_a_layer_whose_blocks_are_not_whole_runs_of_bytes_is_a_config_error(
    server: CacheServer,
) -> None:
    shape = SHAPES["mla"]
    side, core = _side(server, shape, torch.bfloat16, {})
    try:
        with pytest.raises(ConfigError, match="not one run of bytes"):
            side.register(
                {
                    f"model.layers.{i}.self_attn": torch.zeros(
                        (shape[1], shape[0], shape[2]), dtype=torch.bfloat16
                    ).transpose(0, 1)  # a block's tokens are a block apart
                    for i in range(LAYERS)
                }
            )
        with pytest.raises(ConfigError, match="not pages of"):
            side.register(_caches((BLOCKS, TOKENS, 95), torch.bfloat16, seed=2))
    finally:
        side.close()
        core.close()
