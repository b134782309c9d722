"""``kvbridge bench``: transfer throughput and latency on this machine's link, with the raw
baseline of the same run beside each row.

A target process (``kvbridge.tools._bench_target``) holds a 256 MiB registered region and
a raw-socket sink. For each transport, stream count, block size and batch size, this
process writes batches of blocks at shuffled offsets (so that no two ops merge) for a fixed
time, one batch after the other, and times each batch until it is acknowledged; then it
sends the same bytes over as many raw TCP connections (one thread each, ``sendall`` per
block, one acknowledgement per connection per batch). Throughput is bytes over the summed
batch times; latency is per batch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvbridge.store import parse_size
from kvbridge.transfer import OP_DTYPE, Peer, TransferEngine, ucx_available

from ._bench_wire import (
    RAW_HEADER,
    TOTAL,
    read_ready,
    shuffled_offsets,
    start_target,
    stop_target,
    target_argv,
)


@dataclass(frozen=True)
class BenchRow:
    transport: str
    streams: int
    block_bytes: int
    batch: int
    gbps: float
    raw_gbps: float
    ratio: float
    p50_ms: float
    p99_ms: float
    raw_p50_ms: float
    raw_p99_ms: float


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "bench",
        help="transfer throughput and latency against block size, batch and streams",
        description="Measure the transfer engine on this machine (two processes, loopback) "
        "against raw TCP sockets moving the same bytes in the same run.",
    )
    parser.add_argument("--transports", default="auto", help="tcp, ucx or auto (every one)")
    parser.add_argument("--block-sizes", default="4KiB,64KiB,1MiB,16MiB,64MiB")
    parser.add_argument("--batch", default="1,64", help="blocks per batch (comma-separated)")
    parser.add_argument("--streams", default="1,2,4", help="streams per peer (comma-separated)")
    parser.add_argument("--seconds", type=float, default=0.3, help="time per case and side")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plot", help="draw throughput against block size into this PNG")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        if args.transports == "auto":
            transports = ["tcp", "ucx"] if ucx_available() else ["tcp"]
        else:
            transports = [t.strip() for t in args.transports.split(",")]
            if "ucx" in transports and not ucx_available():
                raise ValueError("the ucx transport needs ucxx: pip install 'kvbridge[ucx]'")
        blocks = [parse_size(b) for b in args.block_sizes.split(",")]
        batches = [int(b) for b in args.batch.split(",")]
        streams = [int(s) for s in args.streams.split(",")]
        if not all(0 < b <= TOTAL for b in blocks) or min(batches + streams) < 1:
            raise ValueError(f"block sizes must be 1 B..{TOTAL >> 20} MiB; batches, streams >= 1")
        if args.plot:
            import matplotlib  # noqa: F401, PLC0415 - fail before the work if missing
    except (ValueError, ImportError) as exc:
        print(f"kvbridge bench: {exc}", file=sys.stderr)
        return 2
    rows = bench(transports, blocks, batches, streams, args.seconds, progress=not args.json)
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


def bench(
    transports: Sequence[str],
    blocks: Sequence[int],
    batches: Sequence[int],
    streams: Sequence[int],
    seconds: float,
    *,
    progress: bool = True,
) -> list[BenchRow]:
    target = start_target(target_argv("2", ",".join(transports)))
    rows: list[BenchRow] = []
    try:
        assert target.stdout is not None
        metadata_hex, port = read_ready(target.stdout)
        source = np.random.default_rng(0).integers(0, 256, TOTAL, dtype=np.uint8)
        if progress:
            print(_header())
        for transport, count in itertools.product(transports, streams):
            with TransferEngine("kvbridge-bench", transports=(transport,), streams=count) as eng:
                region = eng.register(source, access="r")
                peer = eng.connect(bytes.fromhex(metadata_hex))
                raw = RawLink(port, count, source.data)
                link = _Link(transport, count, peer, region.id, next(iter(peer.regions)), raw)
                try:
                    link.measure(1 << 20, 16, seconds)  # warm-up, not reported: the first
                    # fraction of a second after connecting ran 10x slower in every case
                    for block, batch in itertools.product(blocks, batches):
                        row = link.measure(block, min(batch, TOTAL // block), seconds)
                        rows.append(row)
                        if progress:
                            print(_format(row), flush=True)
                finally:
                    raw.close()
    finally:
        stop_target(target)
    return rows


@dataclass
class _Link:
    """One engine peer and the raw connections beside it."""

    transport: str
    streams: int
    peer: Peer
    region: int
    remote: int
    raw: RawLink

    def write(self, block: int, count: int, seed: int) -> None:
        ops = np.zeros(count, OP_DTYPE)
        ops["local_region"], ops["remote_region"] = self.region, self.remote
        ops["local_offset"] = shuffled_offsets(block, count, seed + 1)
        ops["remote_offset"] = shuffled_offsets(block, count, seed)
        ops["length"] = block
        self.peer.write(ops).wait(120)

    def measure(self, block: int, count: int, seconds: float) -> BenchRow:
        ours = _timed(lambda seed: self.write(block, count, seed), seconds)
        raw = _timed(lambda seed: self.raw.send(block, count, seed), seconds)
        nbytes = block * count
        gbps, raw_gbps = nbytes / ours.mean() / 1e9, nbytes / raw.mean() / 1e9
        return BenchRow(
            transport=self.transport,
            streams=self.streams,
            block_bytes=block,
            batch=count,
            gbps=gbps,
            raw_gbps=raw_gbps,
            ratio=gbps / raw_gbps,
            p50_ms=float(np.percentile(ours, 50) * 1e3),
            p99_ms=float(np.percentile(ours, 99) * 1e3),
            raw_p50_ms=float(np.percentile(raw, 50) * 1e3),
            raw_p99_ms=float(np.percentile(raw, 99) * 1e3),
        )


class RawLink:
    """``streams`` raw TCP connections to the target's sink, one sender thread each."""

    def __init__(
        self, port: int, streams: int, source: memoryview, host: str = "127.0.0.1"
    ) -> None:
        self.source = source
        self.conns = [socket.create_connection((host, port)) for _ in range(streams)]
        for conn in self.conns:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, block: int, count: int, seed: int) -> None:
        offsets = shuffled_offsets(block, count, seed)
        streams = len(self.conns)

        def stream(i: int) -> None:
            conn = self.conns[i]
            conn.sendall(RAW_HEADER.pack(block, count, seed, i, streams, 0))
            for offset in offsets[i::streams].tolist():
                conn.sendall(self.source[offset : offset + block])
            conn.recv(1)

        if streams == 1 or count == 1:  # nothing to overlap: no threads
            for i in range(streams):  # a stream with no block still gets its header
                stream(i)
            return
        errors: list[OSError] = []

        def guarded(i: int) -> None:  # a dropped link is the caller's error, not a traceback
            try:
                stream(i)
            except OSError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=guarded, args=(i,)) for i in range(streams)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


def _timed(batch: Callable[[int], None], seconds: float) -> np.ndarray:
    """Run batches for about ``seconds`` (at least 3); return each batch's time."""
    times: list[float] = []
    start = time.perf_counter()
    for seed in itertools.count(1):
        began = time.perf_counter()
        batch(seed)
        times.append(time.perf_counter() - began)
        if len(times) >= 3 and time.perf_counter() - start >= seconds:
            break
    return np.array(times)


def _header() -> str:
    return (
        f"{'transport':9} {'streams':>7} {'block':>8} {'batch':>5} {'GB/s':>7} "
        f"{'raw GB/s':>8} {'ratio':>5} {'p50 ms':>8} {'p99 ms':>8} {'raw p50':>8} {'raw p99':>8}"
    )


def _format(r: BenchRow) -> str:
    size = (
        f"{r.block_bytes >> 20} MiB" if r.block_bytes >= 1 << 20 else f"{r.block_bytes >> 10} KiB"
    )
    return (
        f"{r.transport:9} {r.streams:7d} {size:>8} {r.batch:5d} {r.gbps:7.3f} {r.raw_gbps:8.3f} "
        f"{r.ratio:5.2f} {r.p50_ms:8.3f} {r.p99_ms:8.3f} {r.raw_p50_ms:8.3f} {r.raw_p99_ms:8.3f}"
    )


def plot(rows: Sequence[BenchRow], path: str) -> None:
    import matplotlib  # noqa: PLC0415 - optional

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    figure, axes = plt.subplots(figsize=(8, 5))
    groups: dict[tuple[str, int, int], list[BenchRow]] = {}
    for row in rows:
        groups.setdefault((row.transport, row.streams, row.batch), []).append(row)
    for (transport, streams, batch), group in groups.items():
        sizes = [r.block_bytes for r in group]
        line = axes.plot(sizes, [r.gbps for r in group], marker="o")[0]
        line.set_label(f"{transport}, {streams} streams, batch {batch}")
        raw = [r.raw_gbps for r in group]
        axes.plot(sizes, raw, linestyle="--", color=line.get_color(), alpha=0.5)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("block size (bytes); dashed: raw TCP, same streams")
    axes.set_ylabel("GB/s")
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
