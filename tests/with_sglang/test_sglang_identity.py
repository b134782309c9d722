"""What the SGLang backend's namespace covers (docs/SGLANG.md, "Keys and namespaces"): the
weights by their bytes or commit, read from the model settings SGLang publishes, never the
storage config's ``model_name`` (``--served-model-name`` when one is set), and every
setting that changes the KV bytes of the same token ids. Another namespace is 0 pages
found; a served name alone keeps every page.

SGLang's scheduler publishes its resolved settings before it builds the cache controller
(``runtime_context.publish``); the ``model`` bag is what ``runtime_context.get_model()``
returns. ``published`` stands in SGLang's own ``Model`` record for it (conftest.py says
why); a test that puts SGLang's real accessor back finds none published.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from host_pools import MHAPool
from sglang.srt import runtime_context
from sglang.srt.arg_groups.fields.model import Model
from test_sglang_backend import backend, names

from kvbridge.bindings.sglang import KVBridgeHiCache
from kvbridge.store import CacheServer, ServerConfig

HERE = Path(__file__).parent
COMMITS = ("a" * 40, "b" * 40)
GET_MODEL = runtime_context.get_model
"""SGLang's accessor (conftest.py replaces it for each test)."""

Publish = Callable[..., None]


@pytest.fixture
def server() -> Iterator[CacheServer]:
    with CacheServer(ServerConfig(port=0, host_capacity=64 << 20)) as srv:
        yield srv


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> Publish:
    """``published(**fields)``: from now on, SGLang's published model settings are these."""

    def publish(**fields: Any) -> None:
        model = Model(**fields)
        monkeypatch.setattr(runtime_context, "get_model", lambda: model)

    return publish


def _weights(folder: Path, seed: int) -> Path:
    """A model folder: a config and some bytes of weights that depend on ``seed``."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(bytes([seed]) * 4096)
    return folder


def _writer(server: CacheServer, **change: Any) -> KVBridgeHiCache:
    """A backend that wrote pages 0-2 (``names(3)``) of a seeded pool."""
    pool = MHAPool()
    pool.fill(seed=11)
    made = backend(pool, {"server": server.address, "interface_v1": 1}, **change)
    assert made.batch_set_v1(names(3), pool.slots(0, 1, 2)) == [True] * 3
    return made


def _found(server: CacheServer, extra: dict[str, Any] | None = None, **change: Any) -> int:
    """How many of those pages a backend made now finds."""
    made = backend(
        MHAPool(), {"server": server.address, "interface_v1": 1, **(extra or {})}, **change
    )
    try:
        return int(made.batch_exists(names(3)))
    finally:
        made.close()


def test_one_served_name_over_other_weights_shares_no_page(
    server: CacheServer, published: Publish, tmp_path: Path
) -> None:
    """The review's finding: a base model and its fine-tune, both served as ``chat``, read
    each other's pages. Now the fine-tune finds none; a copy of the base's files at
    another path, served under another name, finds them all."""
    base, tuned = _weights(tmp_path / "a" / "m", 0), _weights(tmp_path / "b" / "m", 1)
    copy = shutil.copytree(base, tmp_path / "c" / "m")
    published(model_path=str(base))
    _writer(server, model_name="chat").close()
    published(model_path=str(tuned))
    assert _found(server, model_name="chat") == 0
    published(model_path=str(copy))
    assert _found(server, model_name="base-under-another-name") == 3


APART = [
    pytest.param({"dtype": "float16"}, id="dtype"),
    pytest.param({"quantization": "fp8"}, id="quantization"),
    pytest.param({"modelopt_quant": "fp8"}, id="modelopt quantization"),
    pytest.param({"kv_cache_dtype": "fp8_e5m2"}, id="kv cache dtype"),  # same pool dtype
    pytest.param({"json_model_override_args": '{"rms_norm_eps": 0.5}'}, id="config override"),
    pytest.param({"load_format": "dummy"}, id="dummy weights"),
    pytest.param({"model_impl": "transformers"}, id="model implementation"),
    pytest.param({"model_config_parser": "mistral"}, id="config parser"),
    pytest.param({"trust_remote_code": True}, id="remote code"),
    pytest.param({"context_length": 65536}, id="context length"),
]


@pytest.mark.parametrize("change", APART)
def test_each_setting_that_changes_kv_bytes_is_another_namespace(
    server: CacheServer, published: Publish, tmp_path: Path, change: dict[str, Any]
) -> None:
    model = str(_weights(tmp_path / "m", 0))
    base = {"model_path": model, "kv_cache_dtype": "fp8_e4m3"}
    published(**base)
    _writer(server).close()
    published(**{**base, **change})
    assert _found(server) == 0
    published(**base, json_model_override_args="{}")  # the default, spelled out
    assert _found(server) == 3


def test_kv_scales_and_config_overrides_are_named_by_their_content(
    server: CacheServer, published: Publish, tmp_path: Path
) -> None:
    """The fp8 KV scales file by its bytes (a copy elsewhere shares, other scales do
    not); the config override by its JSON (key order and spacing do not matter)."""
    model = str(_weights(tmp_path / "m", 0))
    scales = {}
    for name, text in (("a", '{"k": 1.0}'), ("b", '{"k": 1.0}'), ("c", '{"k": 0.5}')):
        (tmp_path / name).mkdir()
        scales[name] = tmp_path / name / "kv_scales.json"
        scales[name].write_text(text)
    override = '{"rope_theta": 500000.0, "rms_norm_eps": 1e-05}'
    published(
        model_path=model,
        quantization_param_path=str(scales["a"]),
        json_model_override_args=override,
    )
    _writer(server).close()
    reordered = '{ "rms_norm_eps": 1e-05,  "rope_theta": 500000.0 }'
    published(
        model_path=model,
        quantization_param_path=str(scales["b"]),
        json_model_override_args=reordered,
    )
    assert _found(server) == 3
    published(
        model_path=model,
        quantization_param_path=str(scales["c"]),
        json_model_override_args=override,
    )
    assert _found(server) == 0


@pytest.fixture
def hub(tmp_path: Path) -> Path:
    """A Hugging Face cache holding ``org/tiny`` at two commits; ``main`` points to the
    first (SGLang's ``download_dir`` is the cache huggingface_hub downloads into)."""
    repo = tmp_path / "hub" / "models--org--tiny"
    for commit in COMMITS:
        (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMITS[0])
    return tmp_path / "hub"


def test_a_hub_model_is_named_by_the_commit_its_branch_points_to(
    server: CacheServer, published: Publish, hub: Path
) -> None:
    published(model_path="org/tiny", download_dir=str(hub))
    _writer(server).close()
    published(model_path="org/tiny", revision=COMMITS[0], download_dir=str(hub))
    assert _found(server) == 3  # the commit main pointed to
    (hub / "models--org--tiny" / "refs" / "main").write_text(COMMITS[1])
    published(model_path="org/tiny", download_dir=str(hub))
    assert _found(server) == 0  # main moved: other weights


def _write_elsewhere(server: CacheServer, extra: dict[str, Any]) -> None:
    """Another process (another engine) writes the pages, served as ``chat``, with no
    model settings published."""
    spec = {"server": server.address, "extra": extra, "model_name": "chat", "seed": 12}
    proc = subprocess.run(
        [sys.executable, str(HERE / "write_pages.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])},
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"write_pages failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    assert json.loads(lines[-1][len("RESULT ") :])["written"] == [True] * 3


def test_without_published_settings_only_a_namespace_setting_shares_pages(
    server: CacheServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where SGLang published no model settings, the served name is all there is, and it
    may be an alias: each process keeps its pages to itself (a warning says why), unless
    the ``namespace`` setting names the weights."""
    monkeypatch.setattr(runtime_context, "get_model", GET_MODEL)  # nothing published here
    _write_elsewhere(server, {})
    assert _found(server, model_name="chat") == 0
    assert "'chat'" in caplog.text and "namespace of their own" in caplog.text
    _write_elsewhere(server, {"namespace": "llama-3-8b"})
    caplog.clear()
    assert _found(server, {"namespace": "llama-3-8b"}, model_name="chat") == 3
    assert "shared by the namespace setting 'llama-3-8b'" in caplog.text
