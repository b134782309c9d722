"""Chained prefix-hash block keys.

A block is ``block_tokens`` consecutive tokens; only full blocks get keys. The key of block
``i`` hashes the key of block ``i - 1`` together with the block's tokens, so equal keys at the
same position mean the whole prefix up to there is identical::

    key_i = H(key_{i-1} || u32le(len(extra)) || extra || tokens_i as int32 little-endian)

The chain starts from a root derived from the namespace (model, KV layout, tenant salt), so
two namespaces never share keys. Everything that enters the hash is bytes with a fixed
encoding: the same tokens give the same keys in every process, on every machine and in every
Python version (``tests/test_keys.py`` holds golden vectors). Python's ``hash()`` is never used.

Algorithms:

``blake3`` (default, 32-byte keys)
    Keyed BLAKE3 with ``k = BLAKE3-derive-key(_BLAKE3_CONTEXT, namespace)`` and
    ``root = BLAKE3-keyed(k, _ROOT_LABEL)``. Collision resistant: in a cache shared by several
    tenants nobody can craft tokens whose key collides with another tenant's block.
``xxh3_128`` (16-byte keys)
    ``root = XXH3-128(_ROOT_LABEL || u32le(len(namespace)) || namespace)``, unkeyed. About 3x
    cheaper, not collision resistant against an adversary: for trusted single-tenant use.
"""

from __future__ import annotations

import array
import struct
from collections.abc import Iterable, Mapping, Sequence, Set
from typing import Literal, NewType

import blake3
import numpy as np
import xxhash

from ._buffers import as_sequence
from ._errors import InvalidKey, InvalidTokens, StoreError
from ._sizes import positive_int

BlockKey = NewType("BlockKey", bytes)
"""A block's key: 32 bytes (BLAKE3) or 16 bytes (XXH3-128)."""

HashAlgo = Literal["blake3", "xxh3_128"]

KEY_BYTES: dict[str, int] = {"blake3": 32, "xxh3_128": 16}
"""Key length per algorithm."""

MAX_TOKEN_ID = 2**31 - 1
"""Token ids are hashed as int32; every real vocabulary (<= 2**18 entries) fits."""

_ROOT_LABEL = b"kvbridge/prefix-hash/v1"
_BLAKE3_CONTEXT = "kvbridge 2026-11-30 prefix-hash v1"
_U32 = struct.Struct("<I")

TokenIds = Sequence[int] | np.ndarray | Iterable[int]

_NOT_TOKEN_SEQUENCES = (str, bytes, bytearray, memoryview, Set, Mapping)
"""Iterables that are not an ordered run of token ids: characters, bytes, unordered sets,
a mapping's keys. Hashing them would give keys, just another prompt's."""


class InvalidNamespace(StoreError, TypeError):
    """``namespace`` (or ``extra``) is not bytes (or, for the namespace, str): ``bytes(5)``
    would silently be five zero bytes, another tenant's chain."""


def prefix_hashes(
    token_ids: TokenIds,
    block_tokens: int,
    *,
    namespace: bytes | bytearray | memoryview | str = b"",
    extra: bytes | bytearray | memoryview | None = None,
    algo: HashAlgo = "blake3",
    parent: BlockKey | None = None,
) -> list[BlockKey]:
    """Return one chained key per full block of ``token_ids``; a partial tail gets none.

    ``token_ids`` may be a list, tuple, range, 1-D integer numpy array or any iterable of
    ints in ``[0, 2**31)``. ``extra`` (LoRA id, multimodal hash, ...) is mixed into every
    block; ``None`` and ``b""`` are the same. ``parent`` continues an existing chain: the
    keys of ``tokens[n:]`` with ``parent=keys[n // block_tokens - 1]`` equal the tail of the
    keys of ``tokens`` when ``n`` is a multiple of ``block_tokens``.

    A token id is an ``int`` (or numpy integer, or any object with ``__index__``); floats
    (even ``1.0``), bools, strings and float or bool arrays are refused, as are ``str``,
    ``bytes``, sets and mappings given as the token sequence. ``namespace`` is ``bytes``
    or ``str`` (UTF-8), ``extra`` is ``bytes`` or ``None`` (bytearray and memoryview work
    for both).

    Raises :class:`InvalidTokens` for negative, too large or non-integer token ids,
    :class:`InvalidNamespace` for a ``namespace`` or ``extra`` of another type,
    ``ValueError`` for a non-positive ``block_tokens`` or unknown ``algo``, and
    :class:`InvalidKey` for a ``parent`` of the wrong length.
    """
    positive_int("block_tokens", block_tokens)
    if not isinstance(algo, str) or algo not in KEY_BYTES:
        raise ValueError(f"unknown hash algorithm {algo!r}; choose one of {sorted(KEY_BYTES)}")
    ns = namespace_bytes(namespace)
    salt = b"" if extra is None else _bytes_of("extra", extra)
    header = _U32.pack(len(salt)) + salt
    data = _token_bytes(token_ids)
    stride = 4 * block_tokens
    count = len(data) // stride

    if parent is not None and (not isinstance(parent, bytes) or len(parent) != KEY_BYTES[algo]):
        raise InvalidKey(f"parent must be a {KEY_BYTES[algo]}-byte key for {algo}")

    keys: list[BlockKey] = []
    append = keys.append
    if algo == "blake3":
        k = blake3.blake3(ns, derive_key_context=_BLAKE3_CONTEXT).digest()
        hasher = blake3.blake3
        prev = parent if parent is not None else hasher(_ROOT_LABEL, key=k).digest()
        for start in range(0, count * stride, stride):
            prev = hasher(prev + header + data[start : start + stride], key=k).digest()
            append(BlockKey(prev))
    else:
        digest = xxhash.xxh3_128_digest
        prev = parent if parent is not None else digest(_ROOT_LABEL + _U32.pack(len(ns)) + ns)
        for start in range(0, count * stride, stride):
            prev = digest(prev + header + data[start : start + stride])
            append(BlockKey(prev))
    return keys


def namespace_bytes(namespace: object) -> bytes:
    """A namespace as bytes: ``bytes`` as it is, ``str`` as UTF-8; anything else (an int,
    whose ``bytes()`` would be that many zero bytes) is :class:`InvalidNamespace`."""
    if isinstance(namespace, str):
        try:
            return namespace.encode()
        except UnicodeEncodeError as exc:
            raise InvalidNamespace(f"namespace is not encodable as UTF-8: {exc}") from None
    return _bytes_of("namespace", namespace)


def _bytes_of(name: str, value: object) -> bytes:
    if not isinstance(value, bytes | bytearray | memoryview):
        allowed = "bytes or str" if name == "namespace" else "bytes or None"
        raise InvalidNamespace(f"{name} must be {allowed}, got {type(value).__name__}")
    return bytes(value)


def _token_bytes(token_ids: TokenIds) -> bytes:
    """Validate token ids and return them as little-endian int32 bytes."""
    arr = token_ids if isinstance(token_ids, np.ndarray) else _token_array(token_ids)
    if arr.ndim != 1:
        raise InvalidTokens(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        raise InvalidTokens(f"token ids must be integers, got dtype {arr.dtype}")
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high > MAX_TOKEN_ID:
        bad = low if low < 0 else high
        raise InvalidTokens(f"token id {bad} is outside [0, 2**31)")
    return arr.astype("<i4", copy=False).tobytes()


def _token_array(token_ids: object) -> np.ndarray:
    """Token ids that are not an array, as one; every element must be an int (anything
    with ``__index__``, which floats, strings and Decimals lack) and not a bool."""
    if isinstance(token_ids, range):
        return np.asarray(token_ids)
    if isinstance(token_ids, _NOT_TOKEN_SEQUENCES):
        raise InvalidTokens(
            f"token ids must be a sequence or array of ints, not {type(token_ids).__name__}"
        )
    try:
        items = token_ids if isinstance(token_ids, list | tuple) else list(token_ids)  # type: ignore[call-overload]
        # array('q') takes only what has __index__, and is faster than np.asarray on a list
        arr = np.frombuffer(array.array("q", items), dtype=np.int64)
    except OverflowError:
        raise InvalidTokens("a token id is outside [0, 2**31)") from None
    except TypeError as exc:
        raise InvalidTokens(f"token ids must be ints: {exc}") from None
    # A bool passed __index__ as 0 or 1: look only at those positions (a BOS id or two)
    for at in np.flatnonzero(arr <= 1).tolist():
        if isinstance(items[at], bool | np.bool_):
            raise InvalidTokens(f"token ids must be ints, not bools: #{at} is {items[at]!r}")
    return arr


KEY_LENGTHS = frozenset(KEY_BYTES.values())
"""The lengths a block key may have (one per hash algorithm)."""


def validate_key(key: object) -> BlockKey:
    """Return ``key`` as a :data:`BlockKey` or raise :class:`InvalidKey`."""
    if type(key) is not bytes or len(key) not in KEY_LENGTHS:
        raise InvalidKey(f"a block key is 16 or 32 bytes, got {type(key).__name__} {key!r:.40}")
    return BlockKey(key)


def check_keys(keys: Sequence[bytes]) -> Sequence[BlockKey]:
    """Validate every key (a 16- or 32-byte ``bytes``) before anything else happens."""
    checked = as_sequence(keys, "keys")
    for key in checked:
        if type(key) is not bytes or len(key) not in KEY_LENGTHS:
            validate_key(key)  # raises InvalidKey with the details
    return checked
