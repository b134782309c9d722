"""Block keys: the documented construction, golden vectors, determinism and input checks."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import blake3
import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvbridge.store import InvalidKey, InvalidTokens, prefix_hashes

# Frozen outputs. If one of these changes, every deployed cache loses all of its hits:
# change the format version in the construction instead of editing these.
GOLDEN = {
    ("blake3", b"", None): [
        "93e87cac8f8db9cb1bf6b4e10208a24c4ec04c3106ebebb15773c1dfbb30e889",
        "ed3e2f80697061464f749e4a462219ee739e781bb8661fe438d29f7485a95393",
    ],
    ("blake3", b"llama-3-8b/bf16", b"lora:7"): [
        "51cd893506fc600836c5ec526d2fe58f4707b218724138c9d3ae620dfd0b5714",
        "6ba8625a0119648d8c7b93047335c7aae50ad67d6db10f238e40c5c3dd76ebd2",
    ],
    ("xxh3_128", b"", None): [
        "27635c40b0748bcda4657f5e86b27d64",
        "f85a254acd4e6cf97f745e9d6dd85881",
    ],
}


@pytest.mark.parametrize(("algo", "namespace", "extra"), list(GOLDEN))
def test_golden_vectors(algo: str, namespace: bytes, extra: bytes | None) -> None:
    keys = prefix_hashes(range(32), 16, namespace=namespace, extra=extra, algo=algo)  # type: ignore[arg-type]
    assert [k.hex() for k in keys] == GOLDEN[(algo, namespace, extra)]


def test_golden_edge_tokens() -> None:
    keys = prefix_hashes([2**31 - 1, 0, 1, 2], 2, namespace="tenant-a", algo="xxh3_128")
    assert [k.hex() for k in keys] == [
        "227859853fea942a5909f2def118694d",
        "a8096c9974cd60bb1c21b12336edc107",
    ]


def _spec_blake3(tokens: list[int], block: int, namespace: bytes, extra: bytes) -> list[str]:
    """The construction written out from the module docstring, independently of the code."""
    k = blake3.blake3(namespace, derive_key_context="kvbridge 2026-11-30 prefix-hash v1").digest()
    prev = blake3.blake3(b"kvbridge/prefix-hash/v1", key=k).digest()
    out = []
    for i in range(len(tokens) // block):
        chunk = struct.pack(f"<{block}i", *tokens[i * block : (i + 1) * block])
        prev = blake3.blake3(prev + struct.pack("<I", len(extra)) + extra + chunk, key=k).digest()
        out.append(prev.hex())
    return out


def _spec_xxh3(tokens: list[int], block: int, namespace: bytes, extra: bytes) -> list[str]:
    prev = xxhash.xxh3_128_digest(
        b"kvbridge/prefix-hash/v1" + struct.pack("<I", len(namespace)) + namespace
    )
    out = []
    for i in range(len(tokens) // block):
        chunk = struct.pack(f"<{block}i", *tokens[i * block : (i + 1) * block])
        prev = xxhash.xxh3_128_digest(prev + struct.pack("<I", len(extra)) + extra + chunk)
        out.append(prev.hex())
    return out


tokens_st = st.lists(st.integers(0, 2**31 - 1), max_size=200)


@given(tokens_st, st.integers(1, 20), st.binary(max_size=16), st.binary(max_size=8))
def test_matches_documented_construction(
    tokens: list[int], block: int, namespace: bytes, extra: bytes
) -> None:
    got = prefix_hashes(tokens, block, namespace=namespace, extra=extra)
    assert [k.hex() for k in got] == _spec_blake3(tokens, block, namespace, extra)
    got = prefix_hashes(tokens, block, namespace=namespace, extra=extra, algo="xxh3_128")
    assert [k.hex() for k in got] == _spec_xxh3(tokens, block, namespace, extra)


@given(tokens_st, st.integers(1, 16), st.integers(0, 200))
def test_prefix_of_tokens_gives_prefix_of_keys(tokens: list[int], block: int, cut: int) -> None:
    full = prefix_hashes(tokens, block)
    head = prefix_hashes(tokens[:cut], block)
    assert full[: len(head)] == head
    assert len(full) == len(tokens) // block


@given(tokens_st, st.integers(1, 16), st.integers(1, 10))
def test_parent_continues_a_chain(tokens: list[int], block: int, blocks_first: int) -> None:
    full = prefix_hashes(tokens, block)
    split = blocks_first * block
    if len(full) <= blocks_first:
        return
    tail = prefix_hashes(tokens[split:], block, parent=full[blocks_first - 1])
    assert tail == full[blocks_first:]


@given(st.lists(st.integers(0, 2**31 - 1), min_size=4, max_size=64), st.binary(max_size=8))
def test_namespaces_and_extras_separate_chains(tokens: list[int], namespace: bytes) -> None:
    base = prefix_hashes(tokens, 4, namespace=namespace)
    assert set(base).isdisjoint(prefix_hashes(tokens, 4, namespace=namespace + b"x"))
    assert set(base).isdisjoint(prefix_hashes(tokens, 4, namespace=namespace, extra=b"e"))
    assert prefix_hashes(tokens, 4, namespace=namespace, extra=b"") == base


def test_one_changed_token_changes_its_block_and_every_later_one() -> None:
    tokens = list(range(64))
    changed = tokens.copy()
    changed[20] = 999
    a, b = prefix_hashes(tokens, 16), prefix_hashes(changed, 16)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


def test_input_forms_agree() -> None:
    tokens = list(range(100, 164))
    expected = prefix_hashes(tokens, 16)
    assert prefix_hashes(tuple(tokens), 16) == expected
    assert prefix_hashes(range(100, 164), 16) == expected
    assert prefix_hashes(iter(tokens), 16) == expected
    for dtype in (np.int32, np.int64, np.uint32, np.uint16, ">i4"):
        assert prefix_hashes(np.array(tokens, dtype=dtype), 16) == expected


def test_key_lengths_and_partial_blocks() -> None:
    assert [len(k) for k in prefix_hashes(range(40), 16)] == [32, 32]
    assert [len(k) for k in prefix_hashes(range(40), 16, algo="xxh3_128")] == [16, 16]
    assert prefix_hashes(range(15), 16) == []
    assert prefix_hashes([], 16) == []


@pytest.mark.parametrize(
    "tokens",
    [[-1], [2**31], [2**63], [2**80], [1.5], [True, False], np.array([[1, 2]]), ["a"]],
)
def test_rejects_bad_tokens(tokens: object) -> None:
    with pytest.raises(InvalidTokens):
        prefix_hashes(tokens, 1)  # type: ignore[arg-type]


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="block_tokens"):
        prefix_hashes([1, 2], 0)
    with pytest.raises(ValueError, match="algorithm"):
        prefix_hashes([1, 2], 1, algo="md5")  # type: ignore[arg-type]
    with pytest.raises(InvalidKey):
        prefix_hashes([1, 2], 1, parent=b"short")  # type: ignore[arg-type]


_CHILD = """
import sys
from kvbridge.store import prefix_hashes
keys = prefix_hashes(range(1000), 16, namespace=b"ns", extra=b"x")
keys += prefix_hashes(range(1000), 16, algo="xxh3_128")
print(",".join(k.hex() for k in keys))
"""


@pytest.mark.slow
def test_same_keys_in_other_processes_and_hash_seeds() -> None:
    outputs = set()
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(result.stdout)
    assert len(outputs) == 1
    local = prefix_hashes(range(1000), 16, namespace=b"ns", extra=b"x")
    local += prefix_hashes(range(1000), 16, algo="xxh3_128")
    assert outputs.pop().strip() == ",".join(k.hex() for k in local)
