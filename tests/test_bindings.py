"""The engine-agnostic connector core without an engine: settings, identities, pages, the
saver, the failure memory, and page-wise puts and gets against a real server process."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import FakeClock, free_port, keys
from serve import ServeProcess

from kvbridge.bindings import (
    ConnectorConfig,
    ConnectorCore,
    Identity,
    LayoutError,
    PagedKV,
    SaveJob,
    pages_of,
)
from kvbridge.bindings.core import HostCopier
from kvbridge.bindings.core._identity import effective_config, settings_digest, settle, weights
from kvbridge.bindings.core._jobs import Saver
from kvbridge.store import (
    BlockNotFound,
    CacheServer,
    ConfigError,
    InvalidBlock,
    ServerConfig,
    StoreClient,
)

PAGE = 4096
LAYERS = 3


def _identity(**change: object) -> Identity:
    fields: dict[str, object] = {
        "engine": "test",
        "model": "m",
        "dtype": "float32",
        "layout": "cpu/2x64",
        "block_tokens": 16,
        "block_bytes": PAGE * LAYERS,
        "shard": "tp0/1",
    }
    fields.update(change)
    return Identity(**fields)  # type: ignore[arg-type]


def _kv(blocks: int = 8, seed: int = 0) -> tuple[list[np.ndarray], PagedKV]:
    rng = np.random.default_rng(seed)
    layers = [rng.integers(0, 256, (blocks, 2, PAGE // 2), dtype=np.uint8) for _ in range(LAYERS)]
    return layers, PagedKV(tuple(pages_of(layer, f"l{i}") for i, layer in enumerate(layers)), "t")


# -- settings -------------------------------------------------------------------------------


def test_an_unknown_setting_is_named() -> None:
    with pytest.raises(ConfigError, match=r"unknown kvbridge connector setting.*serverr"):
        ConnectorConfig.from_extra({"serverr": "x:1", "host_capacity": "1GiB"})


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"host_capacity": "lots"}, "host_capacity"),
        ({"timeout": "5"}, "timeout must be a number"),
        ({"timeout": 0}, "timeout must be a positive"),
        ({"pd_wait": float("inf")}, "pd_wait"),
        ({"server": ""}, "server must be a non-empty string"),
        ({"async_load": "yes"}, "async_load must be true or false"),
        ({"streams": 0}, "streams must be 1..64"),
        ({"streams": "4"}, "streams must be a whole number"),
        ({"disk_path": "/tmp/x"}, "go together"),
        ({"server": "h:1", "disk_path": "/x", "disk_capacity": "1GiB"}, "a server has its own"),
    ],
)
def test_bad_settings_are_config_errors(extra: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ConnectorConfig.from_extra(extra)


def test_a_missing_secret_file_is_a_config_error(tmp_path: Path) -> None:
    config = ConnectorConfig.from_extra(
        {"server": "127.0.0.1:1", "secret_file": str(tmp_path / "no")}
    )
    with pytest.raises(ConfigError, match="secret_file"):
        _ = config.secret


# -- identities: a different layout is a different namespace, so different keys -----------


@pytest.mark.parametrize(
    "change",
    [
        {"model": "m2"},
        {"dtype": "bfloat16"},
        {"layout": "cuda/2x64"},
        {"block_tokens": 32},
        {"block_bytes": PAGE},
        {"shard": "tp1/2"},
        {"extra": "tenant-b"},
        {"settings": "0123"},
    ],
)
def test_any_difference_in_identity_changes_namespace_and_keys(change: dict[str, object]) -> None:
    a, b = _identity(), _identity(**change)
    assert a.namespace() != b.namespace() and len(b.namespace()) <= 256
    config = ConnectorConfig()
    with ConnectorCore(config, a) as core_a, ConnectorCore(config, b) as core_b:
        tokens = list(range(64))
        assert not set(core_a.keys(tokens)) & set(core_b.keys(tokens))


def test_extra_inputs_change_keys() -> None:
    with ConnectorCore(ConnectorConfig(), _identity()) as core:
        tokens = list(range(64))
        assert core.keys(tokens) != core.keys(tokens, b"lora=a")
        assert len(core.keys(tokens[:40])) == 2  # full blocks only


# -- pages ------------------------------------------------------------------------------------


def test_gather_and_scatter_move_whole_pages_of_every_layer() -> None:
    layers, kv = _kv()
    data = kv.gather([5, 1])
    assert data.shape == (2, PAGE * LAYERS)
    for i, layer in enumerate(layers):
        assert data[0, i * PAGE : (i + 1) * PAGE].tobytes() == layer[5].tobytes()
    kv.scatter([0, 2], data)
    for layer in layers:
        assert layer[0].tobytes() == layer[5].tobytes() and layer[2].tobytes() == layer[1].tobytes()


def test_layouts_that_are_not_pages_are_refused() -> None:
    split = np.zeros((2, 8, 64), np.uint8)[:, :, ::2]  # a block is not one run of bytes
    with pytest.raises(LayoutError, match="not one run of bytes"):
        pages_of(split, "split")
    with pytest.raises(LayoutError, match="disagree"):
        PagedKV((np.zeros((4, 64), np.uint8), np.zeros((4, 128), np.uint8)), "t")
    _, kv = _kv()
    with pytest.raises(LayoutError, match="outside"):
        kv.check([8])


# -- the saver --------------------------------------------------------------------------------


def test_the_saver_runs_jobs_in_order_and_flush_waits_for_a_request() -> None:
    ran: list[str] = []
    gate = threading.Event()

    def save(job: SaveJob) -> None:
        gate.wait(5)
        ran.append(job.request)

    with Saver(save) as saver:
        saver.submit([SaveJob("a", (), ()), SaveJob("b", (), ())])
        assert saver.busy("a") and not saver.flush(["a"], timeout=0.05)  # still queued
        gate.set()
        assert saver.flush(["b"], timeout=5) and ran == ["a", "b"] and saver.idle()


def test_a_save_that_raises_is_logged_and_counted_done(caplog: pytest.LogCaptureFixture) -> None:
    def save(job: SaveJob) -> None:
        raise RuntimeError("boom")

    with Saver(save) as saver:
        saver.submit([SaveJob("a", (), ())])
        assert saver.flush(["a"], timeout=5)
    assert "a save of 0 block(s) failed" in caplog.text


# -- against a real server --------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    proc = ServeProcess("--host-capacity", "16MiB", "--lease-ttl", "30")
    yield proc
    proc.kill()


def test_streams_is_the_number_of_data_streams_to_the_server() -> None:
    with CacheServer(ServerConfig(port=0, host_capacity=16 << 20)) as srv:
        config = ConnectorConfig.from_extra({"server": srv.address, "streams": 3})
        with ConnectorCore(config, _identity(extra="streams"), saves=True) as core:
            _, kv = _kv(seed=2)
            core.attach(kv)
            ks = core.keys(list(range(16 * 4)))
            core.save_later([SaveJob("s", tuple(ks), (0, 1, 2, 3))])
            assert core.flush(["s"]) and core.lookup(ks) == 4
            assert srv.engine.stats()["served_streams"] == 3


def test_pages_round_trip_through_a_server_byte_for_byte(server: ServeProcess) -> None:
    ident = _identity(extra="round-trip")
    with ConnectorCore(ConnectorConfig(server=server.address), ident, saves=True) as core:
        layers, kv = _kv(seed=1)
        core.attach(kv)
        ks = core.keys(list(range(16 * 4)))
        expected = kv.gather([3, 6, 0, 7])
        core.save_later([SaveJob("r", tuple(ks), (3, 6, 0, 7))])
        assert core.flush(["r"]) and core.lookup(ks) == 4
        for layer in layers:
            layer[:] = 0
        assert core.load(ks, [1, 2, 4, 5])
        assert np.array_equal(kv.gather([1, 2, 4, 5]), expected)
        assert kv.gather([0])[0].any() == 0  # nothing else was written
        totals = core.stats.totals()
        assert totals["tokens_loaded"] == 64 and totals["bytes_saved"] == 4 * PAGE * LAYERS


def test_a_failed_load_is_not_offered_again_until_its_ttl(server: ServeProcess) -> None:
    clock = FakeClock()
    config = ConnectorConfig(server=server.address, failed_key_ttl=30)
    with ConnectorCore(config, _identity(extra="failures"), saves=True, clock=clock) as core:
        _, kv = _kv(seed=2)
        core.attach(kv)
        ks = core.keys(list(range(16 * 3)))
        core.save_later([SaveJob("r", tuple(ks), (0, 1, 2))])
        assert core.flush(["r"]) and core.lookup(ks) == 3
        core.mark_failed(ks[1:2])
        assert core.lookup(ks) == 1  # stops before the failed key
        clock.advance(30)
        assert core.lookup(ks) == 3


def test_an_unreachable_server_is_a_miss_and_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    gone = ServeProcess("--host-capacity", "4MiB")
    config = ConnectorConfig(server=gone.address, timeout=2)
    with ConnectorCore(config, _identity(extra="gone")) as core:
        gone.kill()
        assert core.lookup(core.keys(list(range(32)))) == 0
        assert core.lookup(core.keys(list(range(32)))) == 0  # paused: not asked again
        assert core.stats.totals()["store_faults"] == 1
    assert caplog.text.count("computing instead") == 1


def test_a_local_model_is_named_by_its_bytes_not_its_path(tmp_path: Path) -> None:
    """Copies agree wherever they are; weights changed in place (one changed stretch in
    the middle of a 3 MiB file, as a merged adapter leaves) are another model; a single
    file (GGUF) is named by its bytes too."""
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, np.uint8)
    names = []
    for where, change in (("a", False), ("b", False), ("c", True)):
        folder = tmp_path / where / "llama"
        folder.mkdir(parents=True)
        written = data.copy()
        if change:
            written[(3 << 20) // 2 : (3 << 20) // 2 + 64 * 1024] ^= 1
        written.tofile(folder / "model.safetensors")
        (folder / "config.json").write_text("{}")
        named = weights(str(folder))
        assert not named.doubt
        names.append(named.name)
    assert names[0] == names[1] != names[2]
    assert names[0].startswith("llama#")
    single = weights(str(tmp_path / "a" / "llama" / "model.safetensors"))
    assert single.name.startswith("model.safetensors#") and not single.doubt


def _hub_snapshot(cache: Path, repo: str, commit: str, ref: str = "main") -> None:
    """A model in a Hugging Face cache as huggingface_hub lays it out: the snapshot of
    ``commit`` and the ref that points to it."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    (folder / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / ref).write_text(commit)


class _ResolvedRevision(str):
    """huggingface_hub's ResolvedRevision as vLLM 0.32 passes it: the text asked for
    ("main"), with the commit it resolved to."""

    resolved: str


def test_a_hub_model_is_named_by_its_commit_not_its_branch(tmp_path: Path) -> None:
    """``main`` moved between two engines: other weights, another name. A commit, or a
    revision vLLM resolved, names itself; a branch with no commit in the cache is in doubt."""
    old, new = "a" * 40, "b" * 40
    _hub_snapshot(tmp_path, "org/model", old)
    before = weights("org/model", None, str(tmp_path))
    _hub_snapshot(tmp_path, "org/model", new)
    after = weights("org/model", "main", str(tmp_path))
    assert (before.name, after.name) == (f"org/model@{old}", f"org/model@{new}")
    assert not before.doubt and not after.doubt
    assert weights("org/model", old, str(tmp_path / "empty")).name == f"org/model@{old}"
    resolved = _ResolvedRevision("main")
    resolved.resolved = old
    assert weights("org/model", resolved, str(tmp_path / "empty")).name == f"org/model@{old}"
    unknown = weights("org/model", "dev", str(tmp_path))
    assert "org/model" in unknown.doubt and "'dev'" in unknown.doubt


_LLAMA = {
    "_name_or_path": "/models/llama",
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "max_position_embeddings": 2048,
    "sliding_window": None,
    "quantization_config": None,
    "eos_token_id": 2,
    "transformers_version": "5.19.0",
    "dtype": "bfloat16",
    "text_config": {"model_type": "llama", "_name_or_path": "/models/llama", "head_dim": 32},
}


def _config_digest(**change: object) -> str:
    return settings_digest({"hf_config": effective_config({**_LLAMA, **change})})


@pytest.mark.parametrize(
    "change",
    [
        {"rms_norm_eps": 0.5},
        {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0}},
        {"max_position_embeddings": 8192},
        {"sliding_window": 4096},
        {"quantization_config": {"quant_method": "fp8"}},
        {"architectures": ["LlamaBidirectionalModel"]},
        {"text_config": {"model_type": "llama", "head_dim": 64}},
    ],
)
def test_config_fields_that_change_kv_bytes_change_the_settings(change: dict[str, object]) -> None:
    assert _config_digest(**change) != _config_digest()


@pytest.mark.parametrize(
    "change",
    [
        {"_name_or_path": "/elsewhere/copy-of-llama"},
        {"transformers_version": "5.16.1"},
        {"eos_token_id": [2, 7]},
        {"dtype": "float32"},  # the engine's compute dtype is a setting of its own
        {"text_config": {"model_type": "llama", "_name_or_path": "/x", "head_dim": 32}},
    ],
)
def test_config_fields_that_do_not_change_kv_bytes_keep_the_settings(
    change: dict[str, object],
) -> None:
    assert _config_digest(**change) == _config_digest()


def _shared_blocks(server: ServeProcess, saved: Identity, asked: Identity) -> int:
    """How many of the blocks an engine of identity ``saved`` stored one of identity
    ``asked`` finds, through one server."""
    config = ConnectorConfig(server=server.address)
    with ConnectorCore(config, saved, saves=True) as first, ConnectorCore(config, asked) as second:
        _, kv = _kv(seed=8)
        first.attach(kv)
        tokens = list(range(16 * 3))
        assert first.save(first.keys(tokens), [0, 1, 2])
        return second.lookup(second.keys(tokens))


def test_other_settings_share_no_block_and_equal_ones_share_all(server: ServeProcess) -> None:
    """The finding of a review: the same files with hf_overrides={"rms_norm_eps": 0.5}
    took the first engine's blocks. A changed setting is another namespace: 0 hits; a
    copy of the config at another path (a served name is no part of it) keeps them all."""
    base = _identity(extra="settings", settings=_config_digest())
    other = _identity(extra="settings", settings=_config_digest(rms_norm_eps=0.5))
    moved = _identity(extra="settings", settings=_config_digest(_name_or_path="/b/llama"))
    assert _shared_blocks(server, base, other) == 0
    assert _shared_blocks(server, base, moved) == 3


def test_weights_in_doubt_share_nothing_unless_a_namespace_names_them(
    server: ServeProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """An engine that cannot name its weights says so, and its blocks are its own (two
    processes draw two salts); a ``namespace`` setting names them, and is shared."""
    doubt = "model 'org/model' at revision 'main' names no commit"
    alone = _identity(model="org/model@main")
    one, two = settle(alone, doubt, salt="p1"), settle(alone, doubt, salt="p2")
    assert "org/model" in caplog.text and "namespace of their own" in caplog.text
    assert _shared_blocks(server, one, two) == 0
    caplog.clear()
    named = _identity(model="org/model@main", extra="llama-3-8b-2024-07")
    assert settle(named, doubt, salt="p1") == named == settle(named, doubt, salt="p2")
    assert "shared by the namespace setting 'llama-3-8b-2024-07'" in caplog.text
    assert _shared_blocks(server, named, named) == 3
    caplog.clear()
    assert settle(alone, "", salt="p1") == alone and not caplog.text


def test_a_server_down_at_start_is_a_warning_and_is_used_once_it_is_up() -> None:
    """An engine starts without its cache server; the store is tried again after the
    pause, and the memory attached meanwhile is registered when it is reached."""
    port, clock = str(free_port()), FakeClock()
    config = ConnectorConfig(server=f"127.0.0.1:{port}", timeout=2)
    with ConnectorCore(config, _identity(extra="late"), clock=clock) as core:
        _, kv = _kv(seed=5)
        core.attach(kv)
        ks = core.keys(list(range(32)))
        assert core.lookup(ks) == 0 and not core.save(ks[:2], [0, 1])
        late = ServeProcess("--port", port, "--host-capacity", "4MiB")
        try:
            assert not core.save(ks[:2], [0, 1])  # still paused: not asked
            clock.advance(6)
            assert core.save(ks[:2], [0, 1]) and core.lookup(ks) == 2
            assert core.load(ks[:2], [6, 7])
            np.testing.assert_array_equal(kv.gather([6, 7]), kv.gather([0, 1]))
        finally:
            late.kill()
        assert core.stats.totals()["store_faults"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("partial", [True, False], ids=["leading-run load", "all-or-nothing"])
def test_calls_during_the_pause_are_misses_that_neither_extend_it_nor_hide_keys(
    partial: bool,
) -> None:
    """A frozen server: the first call waits its timeout and pauses the store; calls in
    the pause are misses at once and add no fault; after it the keys are offered again,
    but for the keys of a failed all-or-nothing (vLLM) load, kept back for failed_key_ttl."""
    frozen, clock = ServeProcess("--host-capacity", "4MiB"), FakeClock()
    config = ConnectorConfig(server=frozen.address, timeout=1)
    try:
        with ConnectorCore(config, _identity(extra="pause"), clock=clock) as core:
            _, kv = _kv(seed=6)
            core.attach(kv)
            ks = core.keys(list(range(48)))
            assert core.save(ks, [0, 1, 2])
            frozen.freeze()
            assert core.load_leading(ks, [3, 4, 5], partial=partial) == 0  # waits 1 s
            frozen.proc.send_signal(signal.SIGCONT)
            for _ in range(3):
                clock.advance(1.5)  # within the 5 s pause
                assert core.load_leading(ks, [3, 4, 5], partial=partial) == 0
            assert core.stats.totals()["store_faults"] == 1
            clock.advance(1.0)  # 5.5 s after the fault
            assert core.lookup(ks) == (3 if partial else 0)
            assert core.load_leading(ks, [3, 4, 5]) == 3
    finally:
        frozen.proc.send_signal(signal.SIGCONT)
        frozen.kill()


def test_a_closed_core_answers_misses(server: ServeProcess) -> None:
    core = ConnectorCore(ConnectorConfig(server=server.address), _identity(extra="closed"))
    _, kv = _kv(seed=7)
    core.attach(kv)
    ks = core.keys(list(range(32)))
    assert core.save(ks[:1], [0])
    core.close()
    assert core.lookup(ks) == 0
    assert not core.save(ks[:1], [0]) and not core.clear()
    assert core.load_leading(ks[:1], [1]) == 0 and not core.load(ks[:1], [1])
    assert core.stats.totals()["store_faults"] == 0


def test_put_pages_and_get_pages_check_their_offsets(server: ServeProcess) -> None:
    with StoreClient(server.address, block_bytes=PAGE * LAYERS, namespace="pages") as client:
        _, kv = _kv(seed=3)
        regions = [client.register(page) for page in kv.pages]
        ks = keys(0, 2)
        with pytest.raises(InvalidBlock, match="offsets of"):
            client.put_pages(ks, regions, np.zeros((2, LAYERS - 1), np.int64))
        with pytest.raises(InvalidBlock, match="outside its region"):
            client.put_pages(ks, regions, np.full((2, LAYERS), 8 * PAGE, np.int64))
        assert client.contains(ks) == [False, False]  # refused: nothing stored
        with pytest.raises(BlockNotFound):
            client.pin(ks)


# -- the staged path (what a KV cache in GPU memory takes; forced here for host memory) -----


def _staged(server: ServeProcess, blocks: int = 3, **extra: object) -> ConnectorConfig:
    """A connector that moves every page through a staging buffer of ``blocks`` blocks."""
    settings = {
        "server": server.address,
        "staging": "always",
        "staging_bytes": blocks * PAGE * LAYERS,
    }
    return ConnectorConfig.from_extra({**settings, **extra})


def test_staged_pages_round_trip_byte_for_byte_in_chunks(
    server: ServeProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """Seven blocks through a buffer of three: three chunks each way; the loaded blocks
    are the saved ones, and no other block of the cache is touched."""
    ident = _identity(extra="staged")
    with (
        caplog.at_level(logging.INFO, logger="kvbridge.bindings"),
        ConnectorCore(_staged(server), ident, saves=True) as core,
    ):
        layers, kv = _kv(blocks=16, seed=3)
        core.attach(kv)
        ks = core.keys(list(range(16 * 7)))
        saved = [9, 2, 14, 0, 5, 11, 7]
        expected = kv.gather(saved)
        assert core.save(ks, saved) and core.lookup(ks) == 7
        before = [layer.copy() for layer in layers]
        loaded = [1, 3, 4, 6, 8, 10, 12]
        for block in loaded:
            kv.scatter([block], np.zeros((1, kv.block_bytes), np.uint8))
        assert core.load(ks, loaded)
        assert np.array_equal(kv.gather(loaded), expected)
        assert core.stats.totals()["bytes_staged"] == 14 * kv.block_bytes  # 7 out, 7 in
        others = [b for b in range(16) if b not in loaded]
        for layer, old in zip(layers, before, strict=True):
            assert np.array_equal(layer[others], old[others])
    assert "stages pages through 0 MiB of host memory (3 blocks" in caplog.text


def test_staged_and_direct_paths_store_the_same_bytes(server: ServeProcess) -> None:
    ident = _identity(extra="staged-vs-direct")
    direct = ConnectorConfig(server=server.address)
    with ConnectorCore(_staged(server, 2), ident) as staged, ConnectorCore(direct, ident) as plain:
        _, kv = _kv(seed=4)
        staged.attach(kv)
        ks = staged.keys(list(range(16 * 5)))
        assert staged.save(ks, [0, 1, 2, 3, 4])
        _, other = _kv(seed=5)
        plain.attach(other)
        assert plain.load(ks, [7, 6, 5, 4, 3])  # loaded directly, what was staged out
        assert np.array_equal(other.gather([7, 6, 5, 4, 3]), kv.gather([0, 1, 2, 3, 4]))


def test_host_memory_moves_directly_unless_staging_is_always(
    server: ServeProcess, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.INFO, logger="kvbridge.bindings"),
        ConnectorCore(ConnectorConfig(server=server.address), _identity(extra="d")) as core,
    ):
        _, kv = _kv(seed=6)
        core.attach(kv)
        ks = core.keys(list(range(16)))
        assert core.save(ks, [0]) and core.load(ks, [1])
    assert "stages pages" not in caplog.text  # no staging buffer was made


def test_a_copy_that_fails_is_a_miss_and_the_connector_goes_on(
    server: ServeProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device error in the middle of a load's copies (here: the second chunk's) fails
    that load only: a miss, counted as a fault, never an exception into the engine; the
    next load works."""
    with ConnectorCore(_staged(server, 2), _identity(extra="copy-fails"), saves=True) as core:
        _, kv = _kv(blocks=16, seed=7)
        core.attach(kv)
        ks = core.keys(list(range(16 * 4)))
        assert core.save(ks, [0, 1, 2, 3])
        real = HostCopier.scatter
        calls = [0]

        def failing(self: HostCopier, memory: object, offsets: object, rows: object) -> None:
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            real(self, memory, offsets, rows)  # type: ignore[arg-type]

        monkeypatch.setattr(HostCopier, "scatter", failing)
        assert not core.load(ks, [8, 9, 10, 11])  # a miss: the engine recomputes
        assert core.stats.totals()["store_faults"] == 1
        monkeypatch.undo()
        later = core.keys(list(range(1000, 1000 + 16 * 2)))
        assert core.save(later, [4, 5]) and core.load(later, [12, 13])
        assert np.array_equal(kv.gather([12, 13]), kv.gather([4, 5]))


def test_a_staging_buffer_smaller_than_a_block_is_a_config_error(server: ServeProcess) -> None:
    config = ConnectorConfig.from_extra(
        {"server": server.address, "staging": "always", "staging_bytes": PAGE}
    )
    with ConnectorCore(config, _identity(extra="small")) as core:
        _, kv = _kv()
        with pytest.raises(ConfigError, match="staging_bytes"):
            core.attach(kv)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"staging": "sometimes"}, "staging must be one of auto, always"),
        ({"transports": "udp"}, "transports must be one of tcp, ucx, nixl, auto"),
        ({"staging_bytes": "0"}, "staging_bytes"),
    ],
)
def test_bad_staging_settings_are_config_errors(extra: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ConnectorConfig.from_extra(extra)
