"""``kvbridge linkcheck``: kvbridge against a link of known speed.

With root and iproute2 it makes two network namespaces joined by a veth pair, limits each
direction with ``tc tbf`` to each ``--rates`` value, runs a transfer engine target in one
namespace and the measuring client in the other, and reports the engine's goodput as a
fraction of the configured rate (with raw TCP through the same link beside it) and the time
to move one request's KV cache (``--model``, ``--prompt-tokens``) against the ideal
``bytes / rate``. Without root it measures on loopback, unshaped, and says so. Added delay
(``netem``) is not available on this kernel and is not attempted.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
from typing import Any

from ._bench_wire import read_ready, start_target, stop_target, target_argv
from ._models import PRESETS
from ._netns import NetnsUnavailable, ShapedLink, available, remove_stale


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "linkcheck",
        help="engine goodput on a shaped link (network namespaces + tc tbf)",
        description="Measure kvbridge on veth links shaped to known rates (root), or on "
        "loopback without root.",
    )
    parser.add_argument("--rates", default="1,10,25", help="link rates in Gbit/s")
    parser.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(PRESETS))
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--loopback", action="store_true", help="skip namespaces")
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        rates = [float(r) for r in args.rates.split(",")]
        if min(rates) <= 0 or args.seconds <= 0 or args.streams < 1:
            raise ValueError("rates, --seconds and --streams must be positive")
    except ValueError as exc:
        print(f"kvbridge linkcheck: {exc}", file=sys.stderr)
        return 2
    model = PRESETS[args.model]
    request_bytes = model.kv_bytes_per_token * args.prompt_tokens
    block_bytes = model.block_bytes(args.block_tokens)
    reason = "--loopback" if args.loopback else available()
    previous = signal.signal(signal.SIGTERM, _interrupt)  # cleanup runs on SIGTERM too
    results = []
    try:
        if reason is None:
            remove_stale()
            for index, rate in enumerate(rates):
                with ShapedLink(rate * 1e9, index=index) as link:
                    results.append(_measure(args, request_bytes, block_bytes, rate, link))
        else:
            if not args.json:
                print(f"linkcheck on loopback, unshaped ({reason}): no rate to compare with")
            results.append(_measure(args, request_bytes, block_bytes, None, None))
    except NetnsUnavailable as exc:
        print(f"kvbridge linkcheck: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(format_results(results, args.model, args.prompt_tokens))
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _measure(
    args: argparse.Namespace,
    request_bytes: int,
    block_bytes: int,
    rate_gbps: float | None,
    link: ShapedLink | None,
) -> dict[str, Any]:
    host = link.addresses[1] if link else "127.0.0.1"
    argv = target_argv("2", "tcp", host)
    target = start_target(link.command(1, argv) if link else argv)
    try:
        assert target.stdout is not None
        metadata_hex, port = read_ready(target.stdout)
        client_argv = [
            *(sys.executable, "-m", "kvbridge.tools._linkcheck_client", metadata_hex, host),
            *(str(port), str(args.seconds), str(request_bytes), str(block_bytes)),
            str(args.streams),
        ]
        done = subprocess.run(
            link.command(0, client_argv) if link else client_argv,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if done.returncode != 0:
            raise NetnsUnavailable(f"the measuring client failed: {done.stderr.strip()[-500:]}")
        line = next(x for x in done.stdout.splitlines() if x.startswith("{"))
        measured = json.loads(line)
    finally:
        stop_target(target)
    rate_bytes = rate_gbps * 1e9 / 8 if rate_gbps else None
    request_s = statistics.median(measured["request_s"])
    return {
        "rate_gbps": rate_gbps,
        "goodput_gbps": measured["goodput"] * 8 / 1e9,
        "fraction": measured["goodput"] / rate_bytes if rate_bytes else None,
        "raw_goodput_gbps": measured["raw_goodput"] * 8 / 1e9,
        "raw_fraction": measured["raw_goodput"] / rate_bytes if rate_bytes else None,
        "request_bytes": measured["request_bytes"],
        "request_s": request_s,
        "ideal_request_s": measured["request_bytes"] / rate_bytes if rate_bytes else None,
    }


def format_results(results: list[dict[str, Any]], model: str, prompt_tokens: int) -> str:
    lines = [
        f"{'link':>10}  {'kvbridge':>14}  {'raw TCP':>14}  "
        f"{'one request (' + model + ', ' + str(prompt_tokens) + ' tokens)':>40}"
    ]
    for r in results:
        link = f"{r['rate_gbps']:g} Gbit/s" if r["rate_gbps"] else "loopback"
        ours = f"{r['goodput_gbps']:.2f} Gbit/s"
        raw = f"{r['raw_goodput_gbps']:.2f} Gbit/s"
        if r["fraction"] is not None:
            ours += f" {r['fraction']:.2f}x"
            raw += f" {r['raw_fraction']:.2f}x"
        request = f"{r['request_s'] * 1e3:.1f} ms for {r['request_bytes'] / 2**20:.0f} MiB"
        if r["ideal_request_s"]:
            request += f" (ideal {r['ideal_request_s'] * 1e3:.1f} ms)"
        lines.append(f"{link:>10}  {ours:>14}  {raw:>14}  {request:>40}")
    return "\n".join(lines)
