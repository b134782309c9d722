"""``kvbridge demo``: a prefill/decode pair working through a cache server, on this machine.

The coordinator (this process) measures the loopback link, starts ``kvbridge serve`` and the
prefill and decode workers as separate processes, and feeds them requests: built-in
multi-turn conversations sharing system prompts, or a Mooncake trace (``--trace``) at a
chosen speed-up. Each request goes to a prefill worker (hash the prompt, skip the cached
prefix, push the new blocks), then to a decode worker (pull every block, check every byte).
Block sizes come from a model's shape. At the end it prints what moved, how fast, how much
the cache saved, and how that compares with the link.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import zmq

from kvbridge.store import parse_size
from kvbridge.transfer import TransferSettings

from ._console import Progress
from ._demo_servers import DemoServers
from ._link import link_speed
from ._models import PRESETS, ModelShape, from_hf_config
from ._workload import Request, conversations, load_trace


def add_parser(commands: Any) -> None:
    demo = commands.add_parser(
        "demo",
        help="prefill and decode workers moving KV cache through a cache server",
        description="Start a cache server, prefill and decode workers on this machine and "
        "drive them with multi-turn conversations (or a Mooncake trace); every block decode "
        "pulls is checked byte for byte.",
    )
    demo.add_argument("--model", default="llama-3-8b", choices=sorted(PRESETS))
    demo.add_argument("--model-config", help="a Hugging Face config.json (overrides --model)")
    demo.add_argument("--block-tokens", type=int, default=16)
    demo.add_argument("--prefill", type=int, default=1, help="prefill workers")
    demo.add_argument("--decode", type=int, default=1, help="decode workers")
    demo.add_argument("--conversations", type=int, default=8)
    demo.add_argument("--turns", type=int, default=4)
    demo.add_argument("--trace", help="replay a Mooncake trace (JSON lines) instead")
    demo.add_argument("--requests", type=int, default=40, help="trace requests to replay")
    demo.add_argument("--speedup", type=float, default=20.0, help="trace time compression")
    demo.add_argument("--server-capacity", default="1GiB", help="the server's host memory")
    demo.add_argument(
        "--servers", type=int, default=1, help="servers; more than 1: a cluster on etcd"
    )
    demo.add_argument("--transports", default="tcp", help="tcp, ucx or auto")
    demo.add_argument("--inflight", type=int, default=2, help="requests in flight at most")
    demo.add_argument("--plot", help="draw throughput and latency over time into this PNG")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=run)


@dataclass
class _Outcome:
    request: Request
    sent_at: float = 0.0
    prefill: dict[str, Any] = field(default_factory=dict)
    decode: dict[str, Any] = field(default_factory=dict)


def run(args: argparse.Namespace) -> int:
    try:
        model = from_hf_config(args.model_config) if args.model_config else PRESETS[args.model]
        if min(args.block_tokens, args.prefill, args.decode, args.inflight, args.servers) < 1:
            raise ValueError(
                "--block-tokens, --prefill, --decode, --inflight and --servers must be >= 1"
            )
        if args.trace:
            requests = load_trace(args.trace, limit=args.requests, speedup=args.speedup)
        else:
            requests = conversations(args.conversations, args.turns, seed=args.seed)
        capacity = parse_size(args.server_capacity)
        if args.plot:
            import matplotlib  # noqa: F401, PLC0415 - fail before any work if missing
    except (ValueError, OSError, ImportError) as exc:
        print(f"kvbridge demo: {exc}", file=sys.stderr)
        return 2
    block_bytes = model.block_bytes(args.block_tokens)
    print(
        f"model {model.name}: {model.kv_bytes_per_token / 1024:.1f} KiB of KV per token, "
        f"{args.block_tokens}-token blocks of {block_bytes / 2**20:.2f} MiB; "
        f"{len(requests)} requests",
        flush=True,
    )
    largest = max((len(r.tokens) // args.block_tokens for r in requests), default=0) * block_bytes
    if largest > capacity // 2:  # the server holds unread blocks in up to half its memory
        print(
            f"warning: requests of up to {largest / 1e9:.2f} GB of KV exceed half the server's "
            f"{capacity / 1e9:.2f} GB: blocks may be evicted before decode pulls them (raise "
            "--server-capacity)",
            flush=True,
        )
    streams = TransferSettings().streams
    try:
        link = link_speed(streams)
    except (OSError, RuntimeError) as exc:
        print(f"kvbridge demo: could not measure the loopback link: {exc}", file=sys.stderr)
        return 1
    print(
        f"loopback link (raw TCP, {streams} streams between two processes, as the workers "
        f"move data): {link / 1e9:.2f} GB/s",
        flush=True,
    )
    try:
        with _Cluster(args, model, block_bytes, capacity) as cluster:
            outcomes, wall = cluster.drive(requests)
    except RuntimeError as exc:
        print(f"kvbridge demo: {exc}", file=sys.stderr)
        return 1
    report = summarize(outcomes, wall, block_bytes, args.block_tokens, link)
    print(format_summary(report))
    if args.plot:
        plot(outcomes, args.plot)
        print(f"plot: {args.plot}")
    return 0 if report["verified_blocks"] == report["checked_blocks"] else 1


class _Cluster:
    """The server and worker processes, and the zmq sockets that feed them."""

    def __init__(
        self, args: argparse.Namespace, model: ModelShape, block_bytes: int, capacity: int
    ) -> None:
        self._procs: list[subprocess.Popen[str]] = []  # the workers
        self._servers: DemoServers | None = None
        self._context = zmq.Context()
        self._sockets: dict[str, zmq.Socket[bytes]] = {}
        self.args = args
        try:
            self._servers = DemoServers(args.servers, capacity, args.transports)
            if args.servers > 1:
                print(f"cluster of {args.servers} servers on {self._servers.address}", flush=True)
            endpoints = {}
            for name, kind in (("prefill", zmq.PUSH), ("decode", zmq.PUSH), ("results", zmq.PULL)):
                sock = self._context.socket(kind)
                sock.setsockopt(zmq.LINGER, 0)
                sock.bind("tcp://127.0.0.1:*")
                self._sockets[name] = sock
                endpoints[name] = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            for role, count in (("prefill", args.prefill), ("decode", args.decode)):
                for _ in range(count):
                    self._procs.append(
                        subprocess.Popen(
                            [
                                sys.executable,
                                "-m",
                                "kvbridge.tools._demo_worker",
                                role,
                                self._servers.address,
                                endpoints[role],
                                endpoints["results"],
                                str(args.block_tokens),
                                str(block_bytes),
                                model.name,
                                args.transports,
                            ],
                            text=True,
                        )
                    )
            for _ in range(args.prefill + args.decode):
                self._receive(timeout=60.0)  # "ready" from every worker
        except BaseException:
            self.close()
            raise

    def drive(self, requests: list[Request]) -> tuple[list[_Outcome], float]:
        """Send every request through prefill then decode; return outcomes and wall time."""
        outcomes = [_Outcome(r) for r in requests]
        waiting = deque(outcomes)
        inflight, done = 0, 0
        start = time.perf_counter()
        progress = Progress(len(requests))
        while done < len(requests):
            now = time.perf_counter() - start
            while waiting and inflight < self.args.inflight and waiting[0].request.arrival_s <= now:
                outcome = waiting.popleft()
                outcome.sent_at = time.time()
                task = {"id": outcome.request.id, "tokens": outcome.request.tokens.tobytes()}
                self._sockets["prefill"].send(msgpack.packb(task))
                inflight += 1
            next_arrival = waiting[0].request.arrival_s - now if waiting else 1.0
            wait = max(0.001, min(next_arrival, 1.0)) if inflight < self.args.inflight else 1.0
            reply = self._receive(timeout=wait, allow_timeout=True)
            if reply is None:
                continue
            outcome = outcomes[reply["id"]]
            if reply["role"] == "prefill":
                outcome.prefill = reply
                task = {"id": outcome.request.id, "tokens": outcome.request.tokens.tobytes()}
                self._sockets["decode"].send(msgpack.packb(task))
            else:
                outcome.decode = reply
                inflight -= 1
                done += 1
                progress.update(done)
        progress.finish()
        return outcomes, time.perf_counter() - start

    def _receive(self, timeout: float, allow_timeout: bool = False) -> dict[str, Any] | None:
        results = self._sockets["results"]
        if not results.poll(int(timeout * 1000)):
            alive = self._servers is None or self._servers.alive()
            if allow_timeout and alive and all(p.poll() is None for p in self._procs):
                return None
            raise RuntimeError("a demo process died or stopped answering")
        reply: dict[str, Any] = msgpack.unpackb(results.recv())
        return reply

    def close(self) -> None:
        for name, count in (("prefill", self.args.prefill), ("decode", self.args.decode)):
            sock = self._sockets.get(name)
            if sock is not None:
                for _ in range(count):
                    with contextlib.suppress(zmq.Again):  # no worker left to take it
                        sock.send(msgpack.packb({"stop": True}), zmq.NOBLOCK)
        for proc in self._procs:
            _stop(proc, None, 30)
        if self._servers is not None:
            self._servers.close()
        for sock in self._sockets.values():
            sock.close()
        self._context.term()

    def __enter__(self) -> _Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stop(proc: subprocess.Popen[str], sig: int | None, timeout: float) -> None:
    if sig is not None and proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def summarize(
    outcomes: list[_Outcome], wall: float, block_bytes: int, block_tokens: int, link: float
) -> dict[str, Any]:
    prefill = [o.prefill for o in outcomes]
    decode = [o.decode for o in outcomes]
    prompt_tokens = sum(len(o.request.tokens) for o in outcomes)
    loaded = sum(p["cached"] for p in prefill)
    pushed = sum(p["pushed"] for p in prefill)
    offered = sum(p["blocks"] - p["cached"] for p in prefill)
    pulled = sum(d["blocks"] for d in decode)
    bad = sum(p["bad"] for p in prefill) + sum(d["bad"] for d in decode)
    missing = sum(d["missing"] for d in decode)
    moves = np.array([_move_s(o) for o in outcomes])
    sizes = np.array([_moved_blocks(o) * block_bytes for o in outcomes], dtype=float)
    ideal = sizes / link
    moved = (loaded + pushed + pulled) * block_bytes
    return {
        "requests": len(outcomes),
        "prompt_tokens": prompt_tokens,
        "hit_tokens": loaded * block_tokens,
        "loaded_blocks": loaded,
        "pushed_blocks": pushed,
        "saved_blocks": offered - pushed,
        "pulled_blocks": pulled,
        "checked_blocks": loaded + pulled - missing,
        "verified_blocks": loaded + pulled - missing - bad,
        "missing_blocks": missing,
        "block_bytes": block_bytes,
        "wall_s": wall,
        "throughput": moved / wall,
        "move_p50": float(np.percentile(moves, 50)) if len(moves) else 0.0,
        "move_p99": float(np.percentile(moves, 99)) if len(moves) else 0.0,
        "ideal_p50": float(np.percentile(ideal, 50)) if len(ideal) else 0.0,
        "ideal_p99": float(np.percentile(ideal, 99)) if len(ideal) else 0.0,
        "link": link,
    }


def _move_s(o: _Outcome) -> float:
    """Time spent moving one request's KV: prefix load, push, then decode's pull."""
    return float(o.prefill["load_s"] + o.prefill["push_s"] + o.decode["pull_s"])


def _moved_blocks(o: _Outcome) -> int:
    return int(o.prefill["cached"] + o.prefill["pushed"] + o.decode["blocks"])


def format_summary(r: dict[str, Any]) -> str:
    gb = 1e9
    bb = r["block_bytes"]
    hit_rate = r["hit_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0.0
    at_link = f"p50 {r['ideal_p50'] * 1e3:.1f} ms, p99 {r['ideal_p99'] * 1e3:.1f} ms"

    def amount(blocks: int) -> str:
        return f"{blocks * bb / gb:.2f} GB ({blocks:,} blocks)"

    rows = [
        ("requests", f"{r['requests']} in {r['wall_s']:.1f} s"),
        ("prompt tokens", f"{r['prompt_tokens']:,}"),
        ("cache-hit tokens", f"{r['hit_tokens']:,} (hit rate {hit_rate:.1%})"),
        ("KV loaded (hits)", amount(r["loaded_blocks"])),
        ("KV pushed", amount(r["pushed_blocks"])),
        ("KV pulled", amount(r["pulled_blocks"])),
        ("saved by dedup", amount(r["saved_blocks"])),
        ("verified", f"{r['verified_blocks']:,} of {r['checked_blocks']:,} blocks byte for byte"),
        ("evicted too soon", f"{r['missing_blocks']:,} blocks gone before decode pulled them"),
        (
            "throughput",
            f"{r['throughput'] / gb:.2f} GB/s loaded+pushed+pulled "
            f"({r['throughput'] / r['link']:.0%} of the {r['link'] / gb:.2f} GB/s link)",
        ),
        (
            "move one request",
            f"p50 {r['move_p50'] * 1e3:.1f} ms, p99 {r['move_p99'] * 1e3:.1f} ms "
            f"(at link speed: {at_link})",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)


def plot(outcomes: list[_Outcome], path: str) -> None:
    import matplotlib  # noqa: PLC0415 - optional

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    start = min(o.sent_at for o in outcomes)
    done = np.array([o.decode["done_at"] - start for o in outcomes])
    moves = np.array([_move_s(o) * 1e3 for o in outcomes])
    order = np.argsort(done)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    bins = np.arange(0.0, float(done.max()) + 1.0, 1.0)
    counts, edges = np.histogram(done, bins=bins)
    top.step(edges[:-1], counts, where="post")
    top.set_ylabel("requests done per second")
    bottom.plot(done[order], moves[order], ".")
    bottom.set_ylabel("time to move a request's KV (ms)")
    bottom.set_xlabel("seconds since the first request")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
