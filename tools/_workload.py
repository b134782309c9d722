"""Request workloads for the demo: built-in multi-turn conversations, or a Mooncake trace.

A request carries its prompt as token ids; workers hash them into chained block keys
exactly as a serving engine would. Trace requests carry no text, only ``hash_ids`` (one per
512-token block, already chained): each id becomes 512 stand-in token ids that are a pure
function of the id, so equal ids at equal positions give equal tokens, hence equal keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TRACE_BLOCK_TOKENS = 512
VOCABULARY = 128_000


@dataclass(frozen=True)
class Request:
    id: int
    arrival_s: float
    tokens: np.ndarray
    """Prompt token ids (int32)."""


def conversations(
    count: int, turns: int, *, system_prompts: int = 3, seed: int = 0
) -> list[Request]:
    """``count`` conversations of ``turns`` turns, sharing a few system prompts.

    Turn ``t`` of a conversation is turn ``t - 1``'s prompt, the answer (which decode
    produced and nobody cached) and a new user message, so a turn hits the cache for its
    previous prompt. Requests come turn by turn, conversations interleaved, 50 ms apart.
    """
    rng = np.random.default_rng(seed)
    systems = [_tokens(rng, 1024) for _ in range(system_prompts)]
    prompts = [systems[int(rng.integers(system_prompts))] for _ in range(count)]
    requests: list[Request] = []
    for _turn in range(turns):
        for c in range(count):
            answer = _tokens(rng, int(rng.integers(32, 160)))
            user = _tokens(rng, int(rng.integers(48, 320)))
            prompts[c] = (
                np.concatenate((prompts[c], answer, user))
                if _turn
                else (np.concatenate((prompts[c], user)))
            )
            requests.append(Request(len(requests), 0.05 * len(requests), prompts[c]))
    return requests


def load_trace(
    path: str | Path, *, limit: int | None = None, speedup: float = 1.0
) -> list[Request]:
    """Requests of a Mooncake trace (``timestamp`` ms, ``input_length``, ``hash_ids``),
    arrivals divided by ``speedup``. Raises ``ValueError`` naming the bad line."""
    if not speedup > 0:
        raise ValueError(f"speedup must be positive, got {speedup}")
    requests: list[Request] = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                length = int(entry["input_length"])
                ids = [int(h) for h in entry["hash_ids"]]
                arrival = float(entry["timestamp"]) / 1000.0 / speedup
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a trace request ({exc})") from None
            requests.append(Request(len(requests), arrival, _trace_tokens(ids, length)))
    return requests


def _tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCABULARY, n, dtype=np.int32)


def _trace_tokens(hash_ids: list[int], length: int) -> np.ndarray:
    offsets = np.arange(TRACE_BLOCK_TOKENS, dtype=np.int64)
    blocks = [(h * TRACE_BLOCK_TOKENS + offsets) % (2**31 - 1) for h in hash_ids]
    tokens = np.concatenate(blocks) if blocks else np.zeros(0, np.int64)
    return tokens[:length].astype(np.int32)
