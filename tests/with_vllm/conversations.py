"""Multi-turn conversation workloads for the tiny model, from the Mooncake conversation trace
(``tests/data/traces``, whose README says where it comes from).

The trace gives each request one id per 512-token block of its prompt, chained: equal ids
at the same position mean the same prefix. A conversation is a set of requests each
sharing at least two leading blocks with an earlier one of the set (the first block alone
is a system prompt nearly every request shares). Scaled down, each 512-token block becomes
``block`` token ids drawn from the block's id and a seed (two seeds: two workloads of the same
shape sharing no token), and a prompt's length is scaled the same way, so its last block
stays partial where the trace's is."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRACE = Path(__file__).parents[1] / "data" / "traces" / "conversation_first6000.jsonl"
TRACE_BLOCK = 512
VOCAB = 999  # the tiny model's vocabulary is 1,000; 0 is left out


@dataclass(frozen=True)
class Turn:
    """One request: its conversation (numbered from 0) and its prompt."""

    conversation: int
    prompt: list[int]


def workload(
    conversations: int, *, block: int, max_blocks: int, seed: int, turns: int = 3
) -> list[Turn]:
    """The requests of the trace's first ``conversations`` conversations of at least
    ``turns`` requests whose prompts all fit in ``max_blocks`` blocks, in trace order."""
    rows = [json.loads(line) for line in TRACE.read_text().splitlines()]
    chosen = [
        members
        for members in _conversations(rows)
        if len(members) >= turns and all(len(rows[i]["hash_ids"]) <= max_blocks for i in members)
    ][:conversations]
    numbered = sorted((i, number) for number, members in enumerate(chosen) for i in members)
    return [Turn(number, _prompt(rows[i], block, seed)) for i, number in numbered]


def reusable(prompts: list[list[int]], block: int) -> int:
    """Prompt tokens an instance that had run every earlier prompt would not compute: per
    prompt, its leading full blocks some earlier prompt shares, less the last block where
    they cover the whole prompt (vLLM computes at least one token)."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for prompt in prompts:
        full = len(prompt) // block
        shared = 0
        while shared < full and tuple(prompt[: (shared + 1) * block]) in seen:
            shared += 1
        total += min(shared * block, (len(prompt) - 1) // block * block)
        seen.update(tuple(prompt[: (n + 1) * block]) for n in range(full))
    return total


def _conversations(rows: list[dict[str, Any]]) -> list[list[int]]:
    """Request indexes grouped by conversation, each group in trace order, groups by their
    first request."""
    owner: dict[tuple[int, ...], int] = {}
    parent = list(range(len(rows)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, row in enumerate(rows):
        ids = tuple(row["hash_ids"])
        for length in range(len(ids), 1, -1):
            if ids[:length] in owner:
                parent[root(i)] = root(owner[ids[:length]])
                break
        for length in range(2, len(ids) + 1):
            owner.setdefault(ids[:length], i)
    groups: dict[int, list[int]] = {}
    for i in range(len(rows)):
        groups.setdefault(root(i), []).append(i)
    return sorted(groups.values(), key=lambda members: members[0])


def _prompt(row: dict[str, Any], block: int, seed: int) -> list[int]:
    ids = row["hash_ids"]
    tokens = [t for hash_id in ids for t in _block(hash_id, block, seed)]
    scaled = math.ceil(row["input_length"] * block / TRACE_BLOCK)
    return tokens[: max(len(tokens) - block + 1, min(scaled, len(tokens)))]


def _block(hash_id: int, block: int, seed: int) -> list[int]:
    rng = random.Random(f"{seed}/{hash_id}")
    return [rng.randrange(1, VOCAB + 1) for _ in range(block)]
