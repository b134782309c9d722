"""match_prefix over 1,000 keys with 1 million blocks indexed, against a raw dict lookup."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvbridge.store import TieredStore, prefix_hashes

INDEXED = 1_000_000
QUERY = 1_000
BLOCK_BYTES = 16  # the index is what is measured; payloads are kept tiny


def test_match_prefix(compare: Callable[..., Any]) -> None:
    keys = prefix_hashes(range(INDEXED * 4), 4, algo="xxh3_128")
    with TieredStore(BLOCK_BYTES, host_capacity=INDEXED * BLOCK_BYTES) as store:
        chunk = 50_000
        zeros = np.zeros(chunk * BLOCK_BYTES, np.uint8)
        for start in range(0, INDEXED, chunk):
            store.put(keys[start : start + chunk], zeros)
        assert store.stats().tiers[0].blocks == INDEXED
        plain = dict.fromkeys(keys)
        query = keys[INDEXED // 2 : INDEXED // 2 + QUERY]

        def baseline() -> int:
            count = 0
            for k in query:
                if k not in plain:
                    break
                count += 1
            return count

        assert store.match_prefix(query) == baseline() == QUERY
        compare(
            f"match_prefix {QUERY} keys / {INDEXED} indexed",
            lambda: store.match_prefix(query),
            baseline,
            baseline_name="dict lookups",
            rounds=50,
        )
