"""End-to-end checksums on a real vLLM: a block of a real ``kvbridge serve`` damaged in place
between two engine runs (a stray write into the server's memory, through ``/proc``) never
reaches the second engine as KV. It loads the blocks before the damaged one, recomputes from
it on, and answers exactly as a vLLM without kvbridge; its counters name the reason
(``tokens_lost_corrupt``), the server drops the bad block, and the block the engine computed
again is saved in its place, byte for byte the one first saved."""

from __future__ import annotations

import numpy as np
from corruption import overwrite_in_memory
from harness import BLOCK, LOADABLE, PROMPTS, namespace_of, run_engine, spec, tokens
from serve import ServeProcess

from kvbridge.store import BlockKey, StoreClient

GARBAGE = bytes(range(256)) * 4


def _chain(client: StoreClient, blocks: list[list[int]]) -> list[BlockKey]:
    """The keys of the stored chain of blocks whose token ids are ``blocks``, in order."""
    snapshot = client.snapshot(lineage=True)
    assert snapshot.lineage is not None
    by_lineage = {
        (lineage.parent, tuple(lineage.token_ids)): key
        for key, lineage in zip(snapshot.keys, snapshot.lineage, strict=True)
        if lineage is not None
    }
    chain: list[BlockKey] = []
    for block in blocks:
        chain.append(by_lineage[(chain[-1] if chain else None, tuple(block))])
    return chain


def test_a_block_damaged_in_the_server_is_recomputed_and_the_outputs_stay_equal(
    model: str, baseline: list[list[int]]
) -> None:
    server = ServeProcess("--host-capacity", "64MiB")
    try:
        connector = {"server": server.address}
        first = run_engine(spec(model, connector))
        assert tokens(first) == baseline
        name, block_bytes = namespace_of(first["log"])
        with StoreClient(server.address, block_bytes=block_bytes, namespace=name) as client:
            base = PROMPTS[0]  # its second block is every prompt's but the last's
            _, damaged = _chain(client, [base[:BLOCK], base[BLOCK : 2 * BLOCK]])
            data = np.zeros(block_bytes, dtype=np.uint8)
            client.get([damaged], data)
            middle = block_bytes // 2
            needle = data[middle : middle + 64].tobytes()
            assert overwrite_in_memory(server.proc.pid, needle, GARBAGE) == 1
            second = run_engine(spec(model, connector))
            assert tokens(second) == baseline  # recomputed, not read from garbage
            stats = second["stats"]
            assert stats["tokens_lost_corrupt"] >= BLOCK
            assert 0 < stats["tokens_loaded"] < LOADABLE  # the blocks before it loaded
            label = f"{name}/{block_bytes}"
            (figures,) = [n for n in client.server_stats()["namespaces"] if n["name"] == label]
            assert figures["corrupt"] == 1  # the bad copy was dropped ...
            again = np.zeros(block_bytes, dtype=np.uint8)
            client.get([damaged], again)  # ... and the recomputed block saved in its place
            assert np.array_equal(again, data)
    finally:
        server.kill()
