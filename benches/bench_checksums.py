"""What end-to-end checksums cost (``store/_checksums.py``, goal: within 5% at 32 KiB
pages): the same ``StoreClient`` calls against one ``kvbridge serve``, with checksums (the
writer hashes each block's bytes as it sends them, the reader the bytes it received) and
without (the baseline: a client that sends none and checks nothing, otherwise the same).

Pages: 16 blocks of 1 MiB a round, as ``bench_connector.py`` lays them out (32 pages of
32 KiB or 8 of 128 KiB per block, one op each). Blocks: 16 MiB a round in blocks of 4 KiB
to 16 MiB, one contiguous buffer (``bench_transfer.py``'s sizes). The connector's load, its
``verify`` on and off. The transfer engine itself hashes nothing (``bench_transfer.py``,
``bench_engine_pages.py`` measure it unchanged)."""

from __future__ import annotations

import itertools
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from checksum_clients import ROUND_BYTES, PagedRounds, clients
from serve import ServeProcess

from kvbridge._closing import Closing
from kvbridge.bindings import ConnectorConfig, ConnectorCore, Identity, PagedKV, SaveJob
from kvbridge.store import StoreClient, prefix_hashes
from kvbridge.tools import _netns

SHAPED_GBIT = 8.0
"""Below what loopback moves here (~2 GB/s, CPU-bound on two cores)."""
PAGES = [(32, 32 << 10), (8, 128 << 10)]
BLOCKS = [4 << 10, 64 << 10, 1 << 20, 16 << 20]


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    proc = ServeProcess("--host-capacity", "1GiB", "--handoff-ttl", "0", "--max-namespaces", "2")
    yield proc
    proc.kill()


@pytest.mark.parametrize("shape", PAGES, ids=[f"{page >> 10}KiB-pages" for _, page in PAGES])
@pytest.mark.parametrize("direction", ["get", "put"])
def test_pages_with_checksums(
    compare: Callable[..., Any], server: ServeProcess, shape: tuple[int, int], direction: str
) -> None:
    layers, page = shape
    checked, plain = clients(server.address, layers * page, f"pages-{page}")
    with checked, plain:
        rounds = PagedRounds((checked, plain), layers, page)
        count = rounds.count
        compare(
            f"{direction}_pages, {count} x {layers} pages of {page >> 10} KiB, checksums",
            rounds.mover(checked, direction),
            rounds.mover(plain, direction),
            baseline_name="no checksums",
            nbytes=ROUND_BYTES,
        )


class _Driver(Closing):
    """A process moving :class:`PagedRounds` (``checksum_clients.py``), one per request."""

    def __init__(self, command: list[str]) -> None:
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._answer() == "ready"

    def round(self, which: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(which + "\n")
        self.proc.stdin.flush()
        assert self._answer() == "done"

    def _answer(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        self.proc.wait(60)


@pytest.mark.skipif(_netns.available() is not None, reason=f"no namespaces: {_netns.available()}")
@pytest.mark.parametrize("direction", ["get", "put"])
def test_pages_on_a_shaped_link(compare: Callable[..., Any], direction: str) -> None:
    """32 KiB pages where the link, not the CPU, sets the pace (as between machines): a veth
    between two network namespaces shaped to ``SHAPED_GBIT`` (``tc tbf``), the server in
    one, the clients in the other."""
    layers, page = PAGES[0]
    here = Path(__file__).with_name("checksum_clients.py")
    with _netns.ShapedLink(SHAPED_GBIT * 1e9) as link:
        server = ServeProcess(
            *("--host", link.addresses[1], "--insecure", "--host-capacity", "1GiB"),
            *("--handoff-ttl", "0"),
            inside=link.command(1, []),
        )
        try:
            argv = [sys.executable, str(here), server.address, direction, str(layers), str(page)]
            with _Driver(link.command(0, argv)) as driver:
                compare(
                    f"{direction}_pages, 16 x {layers} pages of {page >> 10} KiB, "
                    f"checksums, {SHAPED_GBIT:g} Gbit/s link",
                    lambda: driver.round("checked"),
                    lambda: driver.round("plain"),
                    baseline_name="no checksums",
                    nbytes=ROUND_BYTES,
                )
        finally:
            server.kill()


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b >> 10}KiB" for b in BLOCKS])
@pytest.mark.parametrize("direction", ["get", "put"])
def test_blocks_with_checksums(
    compare: Callable[..., Any], server: ServeProcess, block: int, direction: str
) -> None:
    count = ROUND_BYTES // block
    checked, plain = clients(server.address, block, f"blocks-{block}")
    with checked, plain:
        data = np.random.default_rng(block).integers(0, 256, ROUND_BYTES, np.uint8)
        out = np.empty_like(data)
        rounds = itertools.count()

        def keys() -> list[Any]:
            start = (next(rounds) + 1) << 20
            return prefix_hashes(range(start, start + 16 * count), 16)

        stored = keys()
        checked.put(stored, data)

        def move(client: StoreClient) -> Callable[[], Any]:
            if direction == "get":
                return lambda: client.get(stored, out)
            return lambda: client.put(keys(), data)

        compare(
            f"{direction} of {count} x {block >> 10} KiB blocks, checksums",
            move(checked),
            move(plain),
            baseline_name="no checksums",
            nbytes=ROUND_BYTES,
            rounds=10 if direction == "put" else 20,
        )


@pytest.mark.parametrize("shape", PAGES, ids=[f"{page >> 10}KiB-pages" for _, page in PAGES])
def test_connector_load_with_checksums(
    compare: Callable[..., Any], server: ServeProcess, shape: tuple[int, int]
) -> None:
    """``bench_connector.py``'s load, the connector's ``verify`` on against off (the blocks
    were saved with checksums either way: the reader's check is the difference)."""
    layers, page = shape
    count = ROUND_BYTES // (layers * page)
    rng = [np.random.default_rng(i) for i in range(layers)]
    kv = PagedKV(tuple(r.integers(0, 256, (count + 3, page), np.uint8) for r in rng), "bench")
    identity = Identity("bench", "m", "float32", f"cpu/{layers}", 32, layers * page, "tp0/1", "")
    ids = list(range(3, 3 + count))

    def core(verify: bool) -> ConnectorCore:
        config = ConnectorConfig(server=server.address, verify=verify)
        return ConnectorCore(config, identity, saves=True)

    with core(True) as checked, core(False) as plain:
        for c in (checked, plain):
            c.attach(kv)
        keys = checked.keys(list(range(32 * count)))
        checked.save_later([SaveJob("r", tuple(keys), tuple(ids))])
        assert checked.flush(["r"])
        compare(
            f"connector load, {count} x {layers} pages of {page >> 10} KiB, verify",
            lambda: checked.load(keys, ids) or pytest.fail("load failed"),
            lambda: plain.load(keys, ids) or pytest.fail("load failed"),
            baseline_name="verify off",
            nbytes=ROUND_BYTES,
        )
