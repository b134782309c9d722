"""``kvbridge demo``: multi-turn conversations through a tiered store, end to end.

Until the cache server and transfer engine land, the demo runs prefill and decode in one
process: each request's prompt is hashed into chained block keys, prefill asks the store for
the longest cached prefix, "computes" only the missing blocks (deterministic bytes derived
from each key, standing in for real KV tensors) and puts them; decode then gets every block
and checks each byte. Conversations share a few system prompts and grow turn by turn, so
later turns hit the cache. A small host tier over a disk tier shows eviction and demotion.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvbridge.store import BlockKey, TieredStore, prefix_hashes


@dataclass
class _Totals:
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_blocks: int = 0
    verified_blocks: int = 0


def add_parser(commands: Any) -> None:
    demo = commands.add_parser("demo", help="run multi-turn conversations through a tiered store")
    demo.add_argument("--conversations", type=int, default=48)
    demo.add_argument("--turns", type=int, default=6)
    demo.add_argument("--block-tokens", type=int, default=16)
    demo.add_argument("--block-bytes", type=int, default=64 << 10, help="KV bytes per block")
    demo.add_argument("--host-capacity", default="64MiB")
    demo.add_argument("--disk-capacity", default="512MiB")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=run)


def kv_block(key: BlockKey, block_bytes: int) -> np.ndarray:
    """The stand-in KV bytes of a block: a pure function of its key."""
    seed = int.from_bytes(key[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, block_bytes, dtype=np.uint8)


def _conversations(args: argparse.Namespace) -> list[list[list[int]]]:
    """Each conversation is a list of prompts; turn ``t`` extends turn ``t - 1``."""
    rng = np.random.default_rng(args.seed)
    system_prompts = [rng.integers(0, 128_000, 512).tolist() for _ in range(4)]
    conversations = []
    for _ in range(args.conversations):
        prompt = list(system_prompts[int(rng.integers(len(system_prompts)))])
        turns = []
        for _ in range(args.turns):
            prompt = prompt + rng.integers(0, 128_000, int(rng.integers(40, 400))).tolist()
            turns.append(prompt)
            prompt = prompt + rng.integers(0, 128_000, int(rng.integers(20, 200))).tolist()
        conversations.append(turns)
    return conversations


def run(args: argparse.Namespace) -> int:
    conversations = _conversations(args)
    totals = _Totals()
    started = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix="kvbridge-demo-") as disk_path,
        TieredStore(
            args.block_bytes,
            host_capacity=args.host_capacity,
            disk_path=disk_path,
            disk_capacity=args.disk_capacity,
            namespace=b"demo-model/fp16",
        ) as store,
    ):
        # Interleave conversations turn by turn, as a serving system would see them.
        for turn in range(args.turns):
            for conversation in conversations:
                _serve(store, conversation[turn], args, totals)
        stats = store.stats()
    elapsed = time.perf_counter() - started

    hit_rate = totals.hit_tokens / max(totals.prompt_tokens, 1)
    print(f"requests            {totals.requests}")
    print(f"prompt tokens       {totals.prompt_tokens}")
    print(f"cached tokens       {totals.hit_tokens}  (hit rate {hit_rate:.1%})")
    print(f"blocks computed     {totals.computed_blocks}")
    print(f"blocks verified     {totals.verified_blocks}  (every byte checked)")
    for tier in stats.tiers:
        print(
            f"tier {tier.name:<6}         {tier.blocks}/{tier.capacity_blocks} blocks, "
            f"{tier.evictions} evicted"
        )
    print(
        f"demotions {stats.demotions}, promotions {stats.promotions}, "
        f"dropped {stats.evictions}, duplicates skipped {stats.duplicates}"
    )
    print(f"elapsed             {elapsed:.2f} s")
    return 0


def _serve(
    store: TieredStore, prompt: list[int], args: argparse.Namespace, totals: _Totals
) -> None:
    keys = prefix_hashes(prompt, args.block_tokens, namespace=b"demo-model/fp16")
    cached = store.match_prefix(keys)
    # Prefill: compute and store only the blocks after the cached prefix.
    fresh = keys[cached:]
    if fresh:
        store.put(fresh, [kv_block(key, args.block_bytes) for key in fresh])
    # Decode: pull the whole prompt's KV cache and verify it.
    out = np.empty((len(keys), args.block_bytes), dtype=np.uint8)
    store.get(keys, out)
    for key, block in zip(keys, out, strict=True):
        if not np.array_equal(block, kv_block(key, args.block_bytes)):
            raise AssertionError(f"block {key.hex()[:16]} came back with wrong bytes")
    totals.requests += 1
    totals.prompt_tokens += len(prompt)
    totals.hit_tokens += cached * args.block_tokens
    totals.computed_blocks += len(fresh)
    totals.verified_blocks += len(keys)
