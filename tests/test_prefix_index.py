"""``PrefixIndex``: per publisher, the leading tokens of a prompt it holds, from its events in
either layout; checked against a model that keeps each publisher's held prefixes outright."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbridge.routing import PrefixIndex

SIZE = 2


def _stored(hashes: Sequence[object], parent: object, tokens: list[int], *, array: bool) -> object:
    if array:
        return ["BlockStored", hashes, parent, tokens, SIZE, None, "GPU", None]
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": SIZE,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def test_two_publishers_each_match_the_prefix_they_hold() -> None:
    index = PrefixIndex(SIZE)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # four whole blocks and a token
    index.apply("gpu-a", [_stored([b"a0", b"a1", b"a2", b"a3"], None, prompt[:8], array=False)])
    index.apply("kvbridge", [_stored([10, 11], None, prompt[:4], array=True)])
    assert index.matched(prompt) == {"gpu-a": 8, "kvbridge": 4}
    assert index.matched([1, 2, 3, 99]) == {"gpu-a": 2, "kvbridge": 2}
    assert index.matched([9, 9]) == {}
    index.apply("gpu-a", [["BlockRemoved", [b"a1"], "GPU"]])  # a hole: the rest is unreachable
    assert index.matched(prompt) == {"gpu-a": 2, "kvbridge": 4}
    index.apply("kvbridge", [["AllBlocksCleared"]])
    assert index.matched(prompt) == {"gpu-a": 2}
    index.apply("gpu-a", [{"type": "BlockRemoved", "block_hashes": [b"a0", b"a2", b"a3"]}])
    assert index.matched(prompt) == {} and len(index) == 0  # nothing held: nothing kept


def test_a_chain_continues_from_its_parent_and_an_orphan_is_dropped() -> None:
    index = PrefixIndex(SIZE)
    index.apply("a", [_stored([1], None, [1, 2], array=True)])
    index.apply("a", [_stored([2, 3], 1, [3, 4, 5, 6], array=True)])
    index.apply("a", [_stored([7], 99, [7, 8], array=True)])  # a parent it never told of
    assert index.matched([1, 2, 3, 4, 5, 6, 7, 8]) == {"a": 6}
    assert index.stats.dropped_orphans == 1


def test_what_does_not_fit_the_shape_is_counted_and_skipped() -> None:
    index = PrefixIndex(SIZE)
    bad = [
        ["BlockStored", [1], None, [1, 2, 3], SIZE, None, "GPU", None],  # tokens do not cover
        ["BlockStored", [1], None, [1, 2, 3, 4], 4, None, "GPU", None],  # another block size
        ["BlockStored", [[1]], None, [1, 2], SIZE, None, "GPU", None],  # a hash that is a list
        ["Unknown"],
        "text",
        {"type": "BlockRemoved", "block_hashes": [{}]},
    ]
    index.apply("a", bad)
    assert len(index) == 0 and index.stats.malformed == 5


def test_past_its_bound_the_index_refuses_new_blocks() -> None:
    index = PrefixIndex(SIZE, max_nodes=2)
    index.apply("a", [_stored([1, 2, 3], None, [1, 2, 3, 4, 5, 6], array=True)])
    assert len(index) == 2 and index.stats.refused == 1
    assert index.matched([1, 2, 3, 4, 5, 6]) == {"a": 4}


_OPS = st.lists(
    st.tuples(
        st.sampled_from(["a", "b"]),
        st.sampled_from(["store", "remove", "clear"]),
        st.integers(0, 5),  # which prompt
        st.integers(1, 4),  # how many blocks
    ),
    max_size=40,
)
_PROMPTS = [[p * 100 + i % (p + 2) for i in range(4 * SIZE)] for p in range(6)]


@settings(max_examples=150, deadline=None)
@given(_OPS)
def test_matches_a_model_of_held_prefixes(ops: list[tuple[str, str, int, int]]) -> None:
    """Publishers store a prompt's first blocks (hashes: the prefix they end), remove one,
    or clear; the index's answer for every prompt equals the model's: the longest run of
    leading blocks the publisher holds."""
    index = PrefixIndex(SIZE)
    held: dict[str, set[tuple[int, ...]]] = {"a": set(), "b": set()}
    for source, op, p, blocks in ops:
        prompt = _PROMPTS[p]
        prefixes = [tuple(prompt[: (n + 1) * SIZE]) for n in range(blocks)]
        hashes = [hash((source, prefix)) & 0xFFFF_FFFF for prefix in prefixes]
        if op == "store":
            tokens = prompt[: blocks * SIZE]
            index.apply(source, [_stored(hashes, None, tokens, array=p % 2 == 0)])
            held[source] |= set(prefixes)
        elif op == "remove":
            index.apply(source, [["BlockRemoved", [hashes[-1]], "GPU"]])
            held[source].discard(prefixes[-1])
        else:
            index.apply(source, [["AllBlocksCleared"]])
            held[source].clear()
    for prompt in _PROMPTS:
        want = {}
        for source, kept in held.items():
            n = 0
            while n < 4 and tuple(prompt[: (n + 1) * SIZE]) in kept:
                n += 1
            if n:
                want[source] = n * SIZE
        assert index.matched(prompt) == want
