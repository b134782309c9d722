"""What the bytes of a block mean, and so which blocks two engines may share: an
:class:`Identity` names the engine, the weights, the settings the engine runs them with,
the dtype, layout, block size and shard; its namespace on the server is derived from all
of it.

The weights are named by what they are, never by what they are called: a local directory
or file by a digest of its bytes, a hub model by the commit it was loaded at
(:func:`weights`). A served name is an alias (a base model and its fine-tune may both be
served as ``chat``) and never enters an identity. Where a binding cannot be sure what the
weights are, :func:`settle` says so at start and keeps the engine's blocks in a namespace
no other engine shares, unless the user's ``namespace`` setting names them.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

_log = logging.getLogger("kvbridge.bindings")

_SAMPLE = 16 << 10
_SAMPLES = 64

_COMMIT = re.compile(r"[0-9a-f]{40}")
"""A git commit hash as the Hugging Face hub and its cache write it."""

PROCESS_SALT = secrets.token_hex(8)
"""Random per process: what keeps the blocks of an engine whose weights are uncertain
apart from every other engine's."""

_NOT_KV = frozenset(
    {
        # where the files are: the weights are named by their bytes or their commit
        "_name_or_path",
        # to_dict() writes the running transformers' version, not the file's
        "transformers_version",
        # the checkpoint's dtype: the engine's compute dtype is a setting of its own
        # (and vLLM's Transformers backend rewrites this one while it loads)
        "dtype",
        "torch_dtype",
        # which ids start, stop or pad a sequence, not what a token's KV is
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        # classifier heads and what a forward returns
        "id2label",
        "label2id",
        "num_labels",
        "problem_type",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "use_cache",
        # written while loading by some of vLLM's models (MiniMax-M2's max_model_len, an
        # EAGLE draft's sizes): the engine's own max_model_len is in its settings
        "max_model_len",
        "draft_vocab_size",
        "target_layer_count",
    }
)
"""Keys of a Hugging Face config (top-level or nested) that do not change the KV bytes of
a token sequence."""


@dataclass(frozen=True)
class Identity:
    """What the bytes of a block mean: two engines share blocks only when all of it is
    equal (the namespace is derived from it, and the keys from the namespace)."""

    engine: str
    model: str
    """The weights (:func:`weights`), never a served name."""
    dtype: str
    layout: str
    block_tokens: int
    block_bytes: int
    shard: str
    extra: str = ""
    """The user's ``namespace`` setting (and, where the weights are uncertain, a salt)."""
    settings: str = ""
    """A digest of the engine's settings that change the KV bytes of the same tokens
    (:func:`settings_digest`): the effective model config, compute dtype, quantization,
    KV cache dtype, ..."""

    def namespace(self) -> bytes:
        """``engine/model/digest``: readable, at most 256 bytes, and different whenever any
        field is."""
        text = json.dumps(list(self.__dict__.values()))  # unambiguous: no field bleeds into another
        digest = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
        model = self.model.rstrip("/").rsplit("/", 1)[-1][:96]
        return f"{self.engine}/{model}/{digest}".encode()


@dataclass(frozen=True)
class Weights:
    """What names a model's weights, and ``doubt``: why that name may not say which
    weights they are (empty when it does)."""

    name: str
    doubt: str = ""


def weights(model: str, revision: str | None = None, cache: str | None = None) -> Weights:
    """Name the weights at ``model``: a local directory or file by its bytes
    (:func:`_local`); a hub id by the commit it was loaded at: ``revision`` itself when it
    is a commit or a resolved revision (``huggingface_hub``'s ``ResolvedRevision``, as
    vLLM passes it), else what the local Hugging Face cache (``cache``, else the default
    one) says ``revision`` (``main`` when None) points to. A hub id whose commit cannot be
    found is in doubt: a branch moves, and two engines may have loaded different files."""
    path = Path(model)
    if path.exists():
        return Weights(_local(path))
    commit = _hub_commit(model, revision, cache)
    if commit is not None:
        return Weights(f"{model}@{commit}")
    where = cache or hub_cache()
    return Weights(
        f"{model}@{revision or ''}",
        f"model {model!r} at revision {revision or 'main'!r} is not a local path and no commit "
        f"for it was found in the Hugging Face cache {where}: engines that load it at "
        "different times may run different weights",
    )


def hub_cache() -> str:
    """The Hugging Face hub cache, as ``huggingface_hub`` finds it: ``HF_HUB_CACHE``,
    ``HUGGINGFACE_HUB_CACHE``, ``HF_HOME/hub``, ``XDG_CACHE_HOME/huggingface/hub``, then
    ``~/.cache/huggingface/hub``."""
    home = os.environ.get(
        "HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    )
    hub = os.environ.get("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub"))
    return os.path.expandvars(os.path.expanduser(os.environ.get("HF_HUB_CACHE", hub)))


def _hub_commit(repo: str, revision: str | None, cache: str | None) -> str | None:
    resolved = getattr(revision, "resolved", None)  # huggingface_hub's ResolvedRevision
    if isinstance(resolved, str) and _COMMIT.fullmatch(resolved):
        return resolved
    wanted = str(revision) if revision else "main"
    if _COMMIT.fullmatch(wanted):
        return wanted  # a commit names its files wherever they are
    folder = Path(cache or hub_cache()) / ("models--" + repo.replace("/", "--"))
    try:
        commit = (folder / "refs" / wanted).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    found = _COMMIT.fullmatch(commit) and (folder / "snapshots" / commit).is_dir()
    return commit if found else None


def _local(path: Path) -> str:
    """A local directory by its name and a digest of its files: names, sizes, and
    ``_SAMPLES`` blocks of ``_SAMPLE`` bytes spread evenly over each file (all of a file up
    to a MiB); a single file (GGUF) the same way. The same on every machine that has a
    copy; new weights at the same path make a new namespace, unless they differ only
    between the samples (set ``namespace`` when weights change in place that subtly)."""
    digest = hashlib.blake2b(digest_size=12)
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    for entry in files:
        size = entry.stat().st_size
        digest.update(f"{entry.name}:{size}\n".encode())
        with entry.open("rb") as f:
            for offset in _sample_offsets(size):
                f.seek(offset)
                digest.update(f.read(_SAMPLE))
    return f"{path.resolve().name}#{digest.hexdigest()}"


def _sample_offsets(size: int) -> range | list[int]:
    if size <= _SAMPLES * _SAMPLE:
        return range(0, size, _SAMPLE)  # the whole file
    last = size - _SAMPLE
    return [i * last // (_SAMPLES - 1) for i in range(_SAMPLES)]


def effective_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A model's Hugging Face config as the engine resolved it (``to_dict()``, overrides
    applied), less the keys that do not change the KV bytes (``_NOT_KV``), in it and in
    every nested config (a value with a ``model_type``). Everything else stays: a key
    kept that did not matter costs sharing, one dropped that did costs wrong bytes."""
    return {k: _without_noise(v) for k, v in config.items() if k not in _NOT_KV}


def _without_noise(value: Any) -> Any:
    if isinstance(value, Mapping) and "model_type" in value:
        return effective_config(value)
    return value


def settings_digest(values: Mapping[str, Any]) -> str:
    """A digest of an engine's settings: canonical JSON (sorted keys; dtypes, enums, sets
    and other objects by a text that is the same in every process, never an address)."""
    text = json.dumps(values, sort_keys=True, default=_plain, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return _plain(value.value) if isinstance(value.value, str | int) else value.name
    if isinstance(value, set | frozenset):
        return sorted(map(str, value))
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    return re.sub(r" at 0x[0-9a-fA-F]+", "", f"{type(value).__qualname__}:{value!r}")


def settle(identity: Identity, doubt: str, salt: str = PROCESS_SALT) -> Identity:
    """The identity to use. When the weights are in ``doubt``, a warning says why, and:
    with a ``namespace`` setting (``identity.extra``) the user has named them, and the
    identity stands; without, ``salt`` is mixed in, so that no engine that does not share
    the salt shares a block with this one."""
    if not doubt:
        return identity
    if identity.extra:
        _log.warning(
            "kvbridge: %s. Blocks are shared by the namespace setting %r: every engine that "
            "sets it must run the same weights",
            doubt,
            identity.extra,
        )
        return identity
    _log.warning(
        "kvbridge: %s. This engine's blocks go to a namespace of their own (salt %s) that no "
        "other engine shares; set 'namespace' to a name for exactly these weights to share them",
        doubt,
        salt,
    )
    return replace(identity, extra=f"unshared:{salt}")
