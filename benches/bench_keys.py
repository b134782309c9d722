"""prefix_hashes on a 128k-token prompt, against one unchained hash of the same bytes.

The baseline is the hash function alone over the whole prompt in one call; the ratio shows
what chaining block by block costs. The figure that matters is microseconds per block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import blake3
import numpy as np
import pytest
import xxhash

from kvbridge.store import prefix_hashes

TOKENS = 128 * 1024


@pytest.mark.parametrize("block_tokens", [16, 512])
@pytest.mark.parametrize("algo", ["blake3", "xxh3_128"])
def test_prefix_hashes(compare: Callable[..., Any], block_tokens: int, algo: str) -> None:
    tokens = np.random.default_rng(0).integers(0, 128_000, TOKENS, dtype=np.int32)
    data = tokens.astype("<i4").tobytes()
    if algo == "blake3":
        key = bytes(32)

        def baseline() -> bytes:
            return blake3.blake3(data, key=key, max_threads=1).digest()
    else:

        def baseline() -> bytes:
            return xxhash.xxh3_128_digest(data)

    blocks = TOKENS // block_tokens
    result = compare(
        f"prefix_hashes {algo} {block_tokens}-token blocks",
        lambda: prefix_hashes(tokens, block_tokens, algo=algo),  # type: ignore[arg-type]
        baseline,
        baseline_name=f"one {algo} call",
        rounds=15,
    )
    per_block_us = result.subject_s / blocks * 1e6
    print(f"  {blocks} blocks: {per_block_us:.3f} us per block")
