"""The two clients ``bench_checksums.py`` compares, and rounds of paged gets or puts run by a
process of their own (``python benches/checksum_clients.py ADDRESS get|put LAYERS PAGE``,
inside a network namespace): it answers ``ready``, then per line ``checked`` or ``plain`` on
its standard input moves one round (16 MiB) with that client and answers ``done``."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from kvbridge.store import StoreClient, prefix_hashes
from kvbridge.transfer import Digests

ROUND_BYTES = 16 << 20


class Unchecked(StoreClient):
    """The baseline: this client hashes nothing and sends no checksum (and, made with
    ``verify=False``, checks none): the cost of the checksums is the difference."""

    def _digests(self, ops: int, blocks: int) -> Digests | None:
        return None


def clients(address: str, block_bytes: int, name: str) -> tuple[StoreClient, StoreClient]:
    """A client with checksums and one without, of one namespace."""
    checked = StoreClient(address, block_bytes=block_bytes, namespace=name)
    plain = Unchecked(address, block_bytes=block_bytes, namespace=name, verify=False)
    return checked, plain


class PagedRounds:
    """Rounds of ``get_pages`` or ``put_pages`` of 16 MiB, laid out as
    ``bench_connector.py`` lays a KV cache: ``layers`` buffers, one ``page`` per block each."""

    def __init__(self, clients: tuple[StoreClient, StoreClient], layers: int, page: int) -> None:
        self.count = ROUND_BYTES // (layers * page)
        pages = [
            np.random.default_rng(i).integers(0, 256, self.count * page, np.uint8)
            for i in range(layers)
        ]
        self.offsets = (np.arange(self.count, dtype=np.int64) * page)[:, None].repeat(layers, 1)
        self.regions = {c: [c.register(p) for p in pages] for c in clients}
        self._rounds = itertools.count()
        self.stored = self.keys()
        clients[0].put_pages(self.stored, self.regions[clients[0]], self.offsets)

    def keys(self) -> list[Any]:
        """Keys no round used yet."""
        start = (next(self._rounds) + 1) << 20
        return prefix_hashes(range(start, start + 16 * self.count), 16)

    def mover(self, client: StoreClient, direction: str) -> Callable[[], Any]:
        """One round of ``direction`` by ``client``."""
        if direction == "get":
            return lambda: client.get_pages(self.stored, self.regions[client], self.offsets)
        return lambda: client.put_pages(self.keys(), self.regions[client], self.offsets)


def main(address: str, direction: str, layers: int, page: int) -> None:
    checked, plain = clients(address, layers * page, f"{direction}-{page}")
    with checked, plain:
        rounds = PagedRounds((checked, plain), layers, page)
        moves = {
            "checked": rounds.mover(checked, direction),
            "plain": rounds.mover(plain, direction),
        }
        print("ready", flush=True)
        for line in sys.stdin:
            moves[line.strip()]()
            print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
