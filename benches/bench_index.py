"""The index at scale: ``put`` of tiny blocks (the index is what is measured) and memory per
indexed block, against the cheapest Python index of the same keys.

``KVB_INDEX_BLOCKS`` blocks (default 1,000,000; the issue's target is 10,000,000, which
needs about 3.5 GB) of 16 bytes are put in batches of 50,000 into a host tier; baseline:
``dict.update`` of the same keys with their slot numbers (what any key -> slot index in
Python pays at least). Memory: the process's resident set before and after, per block,
the 16 B slab included; the keys themselves are held by the caller (the store keeps
references, not copies) and counted apart.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
from conftest import _EXTRA_LINES

from kvbridge.store import TieredStore, prefix_hashes

BLOCKS = int(os.environ.get("KVB_INDEX_BLOCKS", "1000000"))
BATCH = 50_000
BB = 16


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_put_new_blocks_at_scale(compare: Callable[..., Any]) -> None:
    keys = prefix_hashes(range(BLOCKS * 4), 4, algo="xxh3_128")
    zeros = np.zeros(BATCH * BB, np.uint8)
    slots = list(range(BLOCKS))
    holder: dict[str, Any] = {}

    def drop() -> None:  # outside the timing: freeing the last round's store
        old = holder.pop("store", None)
        if old is not None:
            old.close()
        del old
        gc.collect()

    def fill_store() -> None:
        before = _rss()
        store = TieredStore(BB, host_capacity=BLOCKS * BB)
        for start in range(0, BLOCKS, BATCH):
            store.put(keys[start : start + BATCH], zeros)
        holder["store"], holder["bytes"] = store, _rss() - before

    def fill_dict() -> None:
        index: dict[bytes, int] = {}
        for start in range(0, BLOCKS, BATCH):
            end = start + BATCH
            index.update(zip(keys[start:end], slots[start:end], strict=True))

    result = compare(
        f"put {BLOCKS:,} new 16 B blocks",
        fill_store,
        fill_dict,
        baseline_name="dict.update of the same keys",
        rounds=3,
        warmup=0,
        setup=drop,
    )
    store = holder["store"]
    query = keys[BLOCKS // 2 : BLOCKS // 2 + 1000]
    assert store.match_prefix(query) == 1000
    line = (
        f"index of {BLOCKS:,} blocks: put {BLOCKS / result.subject_s / 1e3:.0f}k keys/s "
        f"(dict.update {BLOCKS / result.baseline_s / 1e3:.0f}k keys/s); resident "
        f"{holder['bytes'] / BLOCKS:.0f} B per block with the 16 B slab, keys apart "
        f"({sys.getsizeof(keys[0])} B each as Python bytes)"
    )
    store.close()
    _EXTRA_LINES.append(line)
    print(line)
