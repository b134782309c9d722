"""What the vLLM connector's namespace covers (docs/VLLM.md, "Keys and namespaces"): every
setting that changes the KV bytes of the same token ids is another namespace, so another
engine's blocks are never a hit; the served name, and settings that change no byte, keep
the namespace and its hits. Keys derive from the namespace, so another namespace is 0 hits
(``tests/test_bindings.py`` shows it through a server)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from harness import HERE, LOADABLE, other_lane, run_engine, spec, tokens
from serve import ServeProcess

from kvbridge.store import StoreClient

COMMITS = ("a" * 40, "b" * 40)
"""Two commits of a hub model in a local Hugging Face cache; ``main`` points to the first."""


def _namespaces(
    base: dict[str, Any], variants: list[dict[str, Any]], env: dict[str, str]
) -> tuple[str, list[str]]:
    """The namespace of ``base`` and of each variant (``identity_run.py``, one process)."""
    request = {"base": base, "variants": variants}
    proc = subprocess.run(
        [sys.executable, str(HERE / "identity_run.py"), json.dumps(request)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"identity_run failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    return result["base"], result["variants"]


@pytest.fixture(scope="module")
def hub(model: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face cache holding ``org/tiny`` at two commits (the second with other
    weights), as huggingface_hub lays it out; ``main`` points to the first."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--org--tiny"
    for commit, eps in zip(COMMITS, (1e-6, 0.5), strict=True):
        shutil.copytree(model, repo / "snapshots" / commit)
        config = json.loads((Path(model) / "config.json").read_text())
        (repo / "snapshots" / commit / "config.json").write_text(
            json.dumps({**config, "rms_norm_eps": eps})
        )
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMITS[0])
    return cache


CHANGES_BYTES: list[dict[str, Any]] = [
    {"dtype": "bfloat16"},
    {"dtype": "bfloat16", "quantization": "fp8"},
    {"hf_overrides": {"rms_norm_eps": 0.5}},
    {"hf_overrides": {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}},
    {"max_model_len": 1024},
    {"kv_cache_dtype": "fp8"},
    {"load_format": "dummy"},
    {"model": "org/tiny", "revision": COMMITS[1]},
]
"""Settings that change the KV bytes of the same token ids (the fp8 quantization beside
bfloat16 without it; the hub model at the commit that ``main`` does not point to)."""

HUB_MAIN: list[dict[str, Any]] = [
    {"model": "org/tiny"},
    {"model": "org/tiny", "revision": COMMITS[0]},
]
"""The hub model by its branch, and by the commit the branch points to."""


def test_each_setting_that_changes_kv_bytes_is_another_namespace(
    model: str, hub: Path, tmp_path: Path
) -> None:
    """Everything in CHANGES_BYTES runs the same tokens to other KV bytes, over one KV
    cache layout: every namespace differs from every other. The served name, the seed,
    batch limits and a copy of the files at another path do not, and keep the namespace;
    the two names of one hub commit share theirs."""
    copy = tmp_path / "elsewhere" / Path(model).name
    shutil.copytree(model, copy)
    same: list[dict[str, Any]] = [
        {"served_model_name": "chat"},
        {"seed": 7, "max_num_seqs": 4, "max_num_batched_tokens": 128},
        {"model": str(copy)},
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub)}
    base = {"model": model, "dtype": "float32", "max_model_len": 512, "block_size": 32}
    mine, names = _namespaces(base, CHANGES_BYTES + same + HUB_MAIN, env)
    changed = names[: len(CHANGES_BYTES)]
    kept = names[len(CHANGES_BYTES) : -len(HUB_MAIN)]
    branch, commit = names[-len(HUB_MAIN) :]
    assert len({mine, *changed}) == 1 + len(CHANGES_BYTES), list(
        zip(CHANGES_BYTES, changed, strict=True)
    )
    assert kept == [mine] * len(same)
    assert branch == commit and branch not in (mine, *changed)


def _hits(server: ServeProcess) -> dict[int, int]:
    """Lookup hits per namespace (by handle), as any client of the server sees them."""
    with StoreClient(server.address, block_bytes=4096, namespace="observer") as client:
        stats = client.server_stats()
    return {ns["handle"]: ns["hits"] for ns in stats["namespaces"]}


def test_other_settings_of_the_same_files_take_no_block(
    model: str, baseline: list[list[int]]
) -> None:
    """The review's finding on a real vLLM: the same model files run with
    ``hf_overrides={"rms_norm_eps": 0.5}`` took the first engine's blocks and answered
    other tokens than they answer alone. Now they find none of its blocks (its
    namespace's hits do not move; the engine may still reuse what it saved itself) and
    answer as alone; the same engine under another served name takes every block."""
    server = ServeProcess("--host-capacity", "64MiB")
    try:
        connector = {"server": server.address}
        first = run_engine(spec(model, connector))
        assert tokens(first) == baseline and first["stats"]["tokens_saved"] > 0
        eps = {"engine": {"hf_overrides": {"rms_norm_eps": 0.5}}}
        alone = run_engine({**spec(model, None), **eps})
        assert tokens(alone) != baseline  # the override changes what the model computes
        before = _hits(server)
        other = run_engine({**spec(model, connector), **eps})
        after = _hits(server)
        assert {h: after[h] for h in before} == before  # no lookup of it found a block
        assert tokens(other) == tokens(alone)
        renamed = run_engine({**spec(model, connector), "engine": {"served_model_name": "chat"}})
        assert renamed["stats"]["tokens_loaded"] == LOADABLE
        assert tokens(renamed) == baseline
    finally:
        server.kill()


def test_another_vllm_version_of_the_same_kv_format_takes_every_block(
    model: str, baseline: list[list[int]]
) -> None:
    """A fleet upgrading from vLLM 0.32 to 0.33 instance by instance keeps its hits: the
    two versions write one KV format (``kv_format``), so an engine of the other version
    (the other lane's venv) loads every block this one saved, and answers as vLLM alone."""
    other = other_lane()
    if other is None:
        pytest.skip("no other vLLM lane's venv: make it with tests/with_vllm/run-0.33 (or run)")
    python, version = other
    server = ServeProcess("--host-capacity", "64MiB", "--events-port", "0")
    try:
        connector = {"server": server.address}
        first = run_engine(spec(model, connector))
        assert tokens(first) == baseline and first["stats"]["tokens_saved"] > 0
        env = {"VLLM_TARGET_DEVICE": "cpu"}  # the 0.33 lane's CUDA wheel on CPU kernels
        second = run_engine(spec(model, connector, ready=60), python=python, env=env)
        assert second["ready"] is True, version
        assert second["stats"]["tokens_loaded"] == LOADABLE, version
        assert tokens(second) == baseline
    finally:
        server.kill()
