"""How much of a trace's prefix hits land on the first blocks of a prompt, against how many
distinct blocks those are: what choosing ``ClusterClient``'s ``replicated_blocks`` weighs.

``python benches/replica_heads.py TRACE.jsonl [...]``: Mooncake-format traces (JSON lines
with ``hash_ids``, as in Mooncake's ``FAST25-release/traces``). A block is a hit when an
earlier request had the same hash id.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path


def heads(path: Path, lengths: tuple[int, ...] = (1, 2, 4, 8, 16)) -> list[str]:
    seen: set[int] = set()
    first_at: dict[int, int] = {}
    hits: collections.Counter[int] = collections.Counter()
    with path.open() as f:
        for line in f:
            for position, block in enumerate(json.loads(line)["hash_ids"]):
                if block in seen:
                    hits[position] += 1
                seen.add(block)
                first_at.setdefault(block, position)
    total = sum(hits.values())
    rows = []
    for n in lengths:
        share = sum(v for p, v in hits.items() if p < n) / total
        blocks = sum(1 for p in first_at.values() if p < n) / len(first_at)
        rows.append(
            f"{path.name}: first {n:2d} blocks: {share:.1%} of hits, {blocks:.1%} of blocks"
        )
    return rows


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python benches/replica_heads.py TRACE.jsonl [...]")
    for trace in map(Path, sys.argv[1:]):
        print("\n".join(heads(trace)))
