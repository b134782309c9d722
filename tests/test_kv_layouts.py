"""KV caches laid out as vLLM 0.32's ``KVCacheLayout`` s lay them out, on the host (numpy
views of one allocation; ``tests/with_vllm/test_vllm_kv_views.py`` builds them with vLLM's
own code): every layout whose (layer, block) is one dense run of bytes moves byte for byte
through a real server, directly and staged, with one segment per block where a block's
pages of every layer lie side by side; a layout whose block is not one run is refused."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from serve import ServeProcess

from kvbridge.bindings import ConnectorConfig, ConnectorCore, Identity, PagedKV, SaveJob
from kvbridge.bindings.core import LayoutError, pages_of

BLOCKS, HEADS, TOKENS, CONTENT, LAYERS = 10, 2, 4, 256, 3
"""A page is ``[H, N, C]``: 2 heads x 4 tokens x 256 bytes (2 KiB; a block 6 KiB)."""
PAGE = HEADS * TOKENS * CONTENT
PADDED = PAGE + 256

LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
}
"""vLLM 0.32's layouts whose blocks are dense: the physical order of logical axes
``[L, B, H, N, C]`` (``vllm/v1/kv_cache_layout.py``)."""

NOT_PAGES = {"LHBNC": (0, 2, 1, 3, 4), "BHLNC": (1, 2, 0, 3, 4)}


def _views(order: tuple[int, ...], page_step: int = PAGE) -> tuple[np.ndarray, list[np.ndarray]]:
    """One allocation, and one ``[B, H, N, C]`` view per layer of it in ``order``
    (``page_step``: the bytes from one page to the next of the outer two axes, padded
    when larger than a page), as ``compute_layout_strides`` makes them."""
    shape = (LAYERS, BLOCKS, HEADS, TOKENS, CONTENT)
    strides = [0] * 5
    step = 1
    for position, axis in reversed(list(enumerate(order))):
        if position == 1 and {order[0], order[1]} == {0, 1}:
            step = max(step, page_step)  # the page grid: padded pages
        strides[axis] = step
        step *= shape[axis]
    raw = np.random.default_rng(sum(order)).integers(0, 256, step, dtype=np.uint8)
    full = np.lib.stride_tricks.as_strided(raw, shape, tuple(strides))
    return raw, [full[layer] for layer in range(LAYERS)]


def _kv(order: tuple[int, ...], page_step: int = PAGE) -> tuple[np.ndarray, PagedKV]:
    raw, views = _views(order, page_step)
    return raw, PagedKV(tuple(pages_of(v, f"layer{i}") for i, v in enumerate(views)), "test")


def _page(kv: PagedKV, layer: int, block: int) -> bytes:
    return bytes(kv.pages[layer][block])


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    proc = ServeProcess("--host-capacity", "16MiB")
    yield proc
    proc.kill()


@pytest.mark.parametrize("staging", ["auto", "always"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_dense_layout_moves_byte_for_byte(
    server: ServeProcess, layout: str, padded: bool, staging: str
) -> None:
    order = LAYOUTS[layout]
    _, source = _kv(order, PADDED if padded else PAGE)
    target_raw, target = _kv(order, PADDED if padded else PAGE)
    target_raw[:] = 0
    identity = Identity(
        engine="test",
        model="m",
        dtype="uint8",
        layout=f"{layout}/{padded}/{staging}",
        block_tokens=TOKENS,
        block_bytes=PAGE * LAYERS,
        shard="tp0/1",
    )
    config = ConnectorConfig.from_extra(
        {"server": server.address, "staging": staging, "staging_bytes": "16KiB"}
    )
    with (
        ConnectorCore(config, identity, saves=True) as saver,
        ConnectorCore(config, identity) as loader,
    ):
        saver.attach(source)
        loader.attach(target)
        keys = saver.keys(list(range(TOKENS * 4)))
        saver.save_later([SaveJob("r", tuple(keys), (3, 0, 7, 8))])
        assert saver.flush(["r"]) and saver.lookup(keys) == 4
        assert loader.load(keys, [1, 2, 5, 9])
    for layer in range(LAYERS):
        for src, dst in zip((3, 0, 7, 8), (1, 2, 5, 9), strict=True):
            assert _page(target, layer, dst) == _page(source, layer, src), (layer, src)
    untouched = [b for b in range(BLOCKS) if b not in (1, 2, 5, 9)]
    assert not any(_page(target, layer, b).strip(b"\0") for layer in range(3) for b in untouched)
    if padded:  # the padding between pages is never written
        assert not target_raw[~_written(target, target_raw)].any()


def _written(kv: PagedKV, raw: np.ndarray) -> np.ndarray:
    """Which bytes of the allocation ``raw`` the pages cover."""
    first = raw.__array_interface__["data"][0]
    covered = np.zeros(raw.size, dtype=bool)
    for page in kv.pages:
        start = page.__array_interface__["data"][0] - first
        for block in range(BLOCKS):
            at = start + block * page.strides[0]
            covered[at : at + PAGE] = True
    return covered


@pytest.mark.parametrize(
    ("layout", "segments", "buffers"),
    [("LBHNC", LAYERS, LAYERS), ("LBNHC", LAYERS, LAYERS), ("BLHNC", 1, 1), ("BLNHC", 1, 1)],
)
def test_a_block_spanning_every_layer_is_one_segment(
    layout: str, segments: int, buffers: int
) -> None:
    _, kv = _kv(LAYOUTS[layout])
    assert len(kv.segment_buffer) == segments and len(kv.buffers) == buffers
    assert kv.block_bytes == PAGE * LAYERS
    # padded pages of a block-outermost layout are not side by side: a segment per layer
    _, padded = _kv(LAYOUTS[layout], PADDED)
    assert len(padded.segment_buffer) == LAYERS


@pytest.mark.parametrize("layout", list(NOT_PAGES))
def test_a_layout_whose_block_is_not_one_run_is_refused(layout: str) -> None:
    _, views = _views(NOT_PAGES[layout])
    with pytest.raises(LayoutError, match="layer0: a block is not one run of bytes"):
        pages_of(views[0], "layer0")


def test_pages_of_layers_that_overlap_are_refused() -> None:
    raw = np.zeros(BLOCKS * PAGE * 2, np.uint8)
    first = np.lib.stride_tricks.as_strided(raw, (BLOCKS, PAGE), (2 * PAGE, 1))
    second = np.lib.stride_tricks.as_strided(raw[PAGE // 2 :], (BLOCKS, PAGE), (2 * PAGE, 1))
    with pytest.raises(LayoutError, match="overlap"):
        PagedKV((pages_of(first, "l0"), pages_of(second, "l1")), "test")
    with pytest.raises(LayoutError, match="0 blocks"):
        PagedKV((np.zeros((0, PAGE), np.uint8),), "test")
