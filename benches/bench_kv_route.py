"""What ``kvbridge proxy --route kv`` adds to a request: the routing decision (the prompt
walked through ``PrefixIndex`` under its lock, then the pick) for a 4,096-token prompt in
16-token blocks, with an index of 8 instances told of 64 distinct such prompts 4,000 times
(16,384 distinct blocks, each held by several instances), p50/p99, against
``least-loaded``'s pick alone, in the same run."""

from __future__ import annotations

import random
import time

import numpy as np
from conftest import _EXTRA_LINES

from kvbridge.routing import PrefixIndex
from kvbridge.tools._proxy_upstreams import Pool

BLOCK = 16
PROMPT = 4096
PROMPTS = 4000
INSTANCES = 8
DECISIONS = 2000


def _stored(prompt: list[int], salt: int) -> list[object]:
    blocks = len(prompt) // BLOCK
    hashes = [salt * 10_000_000 + n for n in range(blocks)]
    return [["BlockStored", hashes, None, prompt, BLOCK, None, "GPU", None]]


def test_route_kv_decision() -> None:
    rng = random.Random(1)
    index = PrefixIndex(BLOCK)
    prompts = [[rng.randrange(50_000) for _ in range(PROMPT)] for _ in range(64)]
    for n in range(PROMPTS):  # 64 distinct prompts, each held by some of the instances
        index.apply(f"http://prefill-{n % INSTANCES}", _stored(prompts[n % 64], n))
    urls = [f"http://prefill-{i}" for i in range(INSTANCES)]
    pool = Pool("prefill", urls)
    kv, plain = [], []
    for n in range(DECISIONS):
        prompt = prompts[n % 64]
        started = time.perf_counter()
        matched = index.matched(prompt)
        pool.pick(scores={url: matched.get(url, 0) for url in urls} | {"": 0})
        kv.append(time.perf_counter() - started)
        started = time.perf_counter()
        pool.pick()
        plain.append(time.perf_counter() - started)
    kv_us, plain_us = np.array(kv) * 1e6, np.array(plain) * 1e6
    line = (
        f"--route kv decision, {PROMPT}-token prompt, {len(index):,} nodes: p50 "
        f"{np.percentile(kv_us, 50):.0f} us p99 {np.percentile(kv_us, 99):.0f} us; "
        f"least-loaded pick p50 {np.percentile(plain_us, 50):.1f} us p99 "
        f"{np.percentile(plain_us, 99):.1f} us"
    )
    _EXTRA_LINES.append(line)
    print(line)
