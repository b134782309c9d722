"""What the bytes of a block mean, and so which blocks two engines may share: an
:class:`Identity` names the engine, model, dtype, layout, block size and shard; its
namespace on the server is derived from all of it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

_SAMPLE = 16 << 10
_SAMPLES = 64


@dataclass(frozen=True)
class Identity:
    """What the bytes of a block mean: two engines share blocks only when all of it is
    equal (the namespace is derived from it, and the keys from the namespace)."""

    engine: str
    model: str
    dtype: str
    layout: str
    block_tokens: int
    block_bytes: int
    shard: str
    extra: str = ""

    def namespace(self) -> bytes:
        """``engine/model/digest``: readable, at most 256 bytes, and different whenever any
        field is."""
        text = json.dumps(list(self.__dict__.values()))  # unambiguous: no field bleeds into another
        digest = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
        model = self.model.rstrip("/").rsplit("/", 1)[-1][:96]
        return f"{self.engine}/{model}/{digest}".encode()


def model_identity(model: str, revision: str | None) -> str:
    """A hub id with its revision; a local directory by its name and a digest of its files:
    names, sizes, and ``_SAMPLES`` blocks of ``_SAMPLE`` bytes spread evenly over each file
    (all of a file up to a MiB). The same on every machine that has a copy; new weights at
    the same path make a new namespace, unless they differ only between the samples (set
    ``namespace`` when weights change in place that subtly)."""
    path = Path(model)
    if not path.is_dir():
        return f"{model}@{revision or ''}"
    digest = hashlib.blake2b(digest_size=12)
    for entry in sorted(p for p in path.iterdir() if p.is_file()):
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
