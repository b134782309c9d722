"""``kvbridge plan``: how big the KV transfer is, what link it needs, and the pool ratio.

Formulas (``B`` = KV bytes per token, see :mod:`kvbridge.tools._models`):

- per request: ``kv_bytes_per_request = prompt_tokens * B``. Decode needs the KV cache of
  the whole prompt, cached prefix included, so every prompt token crosses the link once.
- link load: ``link_bytes_per_second = rps * kv_bytes_per_request``.
- transfer time of one request at link speed ``L`` bytes/s: ``kv_bytes_per_request / L``.
- prefill time of one request on one prefill instance doing ``prefill_tps`` tokens/s:
  ``prompt_tokens * (1 - hit_rate) / prefill_tps`` (cached tokens are not recomputed).
- link needed for the transfer to take at most ``fraction`` of that prefill time:
  ``kv_bytes_per_request / (fraction * prefill_time)``.
- pools: ``prefill_instances = rps * prompt_tokens * (1 - hit_rate) / prefill_tps`` and
  ``decode_instances = rps * output_tokens / decode_tps`` (aggregate tokens/s of one decode
  instance at its batch size); the ratio is their quotient. A cache hit share ``h`` shrinks
  the prefill pool by the factor ``1 - h`` and leaves the link load unchanged.

Reference points (tests): Llama-3-70B, BF16: 327,680 B = 320 KiB per token (Mooncake);
OPT-66B, FP16, 512 tokens: 1,207,959,552 B = 1.125 GiB ("1.13GB", DistServe); 10 of those a
second: 11.25 GiB/s = 90 Gibit/s (DistServe's "90 Gbps"; 96.6 Gbit/s in decimal units).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, replace
from typing import Any

from ._models import PRESETS, ModelShape, from_hf_config

KV_DTYPES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}


@dataclass(frozen=True)
class Traffic:
    prompt_tokens: int
    output_tokens: int
    rps: float
    hit_rate: float = 0.0


@dataclass(frozen=True)
class Plan:
    model: str
    kv_bytes_per_token: int
    kv_bytes_per_request: int
    link_bytes_per_second: float
    link_gbps_needed_for_load: float
    transfer_seconds: float | None
    prefill_seconds: float | None
    link_gbps_for_fraction: float | None
    prefill_instances: float | None
    prefill_instances_without_cache: float | None
    decode_instances: float | None
    prefill_to_decode: float | None


def make_plan(
    model: ModelShape,
    traffic: Traffic,
    *,
    link_gbps: float | None = None,
    prefill_tps: float | None = None,
    decode_tps: float | None = None,
    fraction: float = 0.1,
) -> Plan:
    """Evaluate the module's formulas. ``link_gbps`` in 10^9 bit/s."""
    if not 0.0 <= traffic.hit_rate < 1.0:
        raise ValueError(f"hit rate must be in [0, 1), got {traffic.hit_rate}")
    if traffic.prompt_tokens < 0 or traffic.output_tokens < 0 or traffic.rps < 0:
        raise ValueError("token counts and the request rate must not be negative")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    per_token = model.kv_bytes_per_token
    per_request = traffic.prompt_tokens * per_token
    load = traffic.rps * per_request
    computed = traffic.prompt_tokens * (1.0 - traffic.hit_rate)
    transfer = per_request / (link_gbps * 1e9 / 8) if link_gbps else None
    prefill_s = computed / prefill_tps if prefill_tps else None
    needed = per_request * 8 / 1e9 / (fraction * prefill_s) if prefill_s else None
    prefill_pool = traffic.rps * computed / prefill_tps if prefill_tps else None
    cold_pool = traffic.rps * traffic.prompt_tokens / prefill_tps if prefill_tps else None
    decode_pool = traffic.rps * traffic.output_tokens / decode_tps if decode_tps else None
    ratio = prefill_pool / decode_pool if prefill_pool is not None and decode_pool else None
    return Plan(
        model=model.name,
        kv_bytes_per_token=per_token,
        kv_bytes_per_request=per_request,
        link_bytes_per_second=load,
        link_gbps_needed_for_load=load * 8 / 1e9,
        transfer_seconds=transfer,
        prefill_seconds=prefill_s,
        link_gbps_for_fraction=needed,
        prefill_instances=prefill_pool,
        prefill_instances_without_cache=cold_pool,
        decode_instances=decode_pool,
        prefill_to_decode=ratio,
    )


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "plan",
        help="KV transfer size, link and pool ratio for a model and traffic mix",
        description="Size the KV-cache transfer of a disaggregated deployment (formulas in "
        "kvbridge/tools/_plan.py).",
    )
    parser.add_argument("--model", default="llama-3-70b", choices=sorted(PRESETS))
    parser.add_argument("--model-config", help="a Hugging Face config.json (overrides --model)")
    parser.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), help="KV cache dtype")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--rps", type=float, default=10.0, help="requests per second")
    parser.add_argument("--hit-rate", type=float, default=0.0, help="prompt share from cache")
    parser.add_argument("--link-gbps", type=float, help="link speed, Gbit/s")
    parser.add_argument("--prefill-tps", type=float, help="prefill tokens/s per instance")
    parser.add_argument("--decode-tps", type=float, help="decode tokens/s per instance")
    parser.add_argument(
        "--fraction", type=float, default=0.1, help="transfer budget as a share of prefill time"
    )
    parser.add_argument("--json", action="store_true")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        model = from_hf_config(args.model_config) if args.model_config else PRESETS[args.model]
        if args.kv_dtype:
            model = replace(model, dtype_bytes=KV_DTYPES[args.kv_dtype])
        traffic = Traffic(args.prompt_tokens, args.output_tokens, args.rps, args.hit_rate)
        plan = make_plan(
            model,
            traffic,
            link_gbps=args.link_gbps,
            prefill_tps=args.prefill_tps,
            decode_tps=args.decode_tps,
            fraction=args.fraction,
        )
    except (ValueError, OSError) as exc:
        print(f"kvbridge plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(asdict(plan), indent=1))
    else:
        print(format_plan(plan, traffic, args))
    return 0


def format_plan(plan: Plan, traffic: Traffic, args: argparse.Namespace) -> str:
    gib = 2**30
    rows = [
        ("model", plan.model),
        (
            "KV per token",
            f"{plan.kv_bytes_per_token:,} B ({plan.kv_bytes_per_token / 1024:.1f} KiB)",
        ),
        (
            "KV per request",
            f"{plan.kv_bytes_per_request / gib:.3f} GiB ({traffic.prompt_tokens:,} prompt tokens)",
        ),
        (
            "link load",
            f"{plan.link_bytes_per_second / gib:.2f} GiB/s = "
            f"{plan.link_bytes_per_second * 8 / gib:.1f} Gibit/s = "
            f"{plan.link_gbps_needed_for_load:.1f} Gbit/s at {traffic.rps:g} requests/s",
        ),
    ]
    if plan.transfer_seconds is not None:
        rows.append(
            (
                "transfer per request",
                f"{plan.transfer_seconds * 1e3:.1f} ms at {args.link_gbps:g} Gbit/s",
            )
        )
    if plan.prefill_seconds is not None and plan.link_gbps_for_fraction is not None:
        rows.append(("prefill per request", f"{plan.prefill_seconds * 1e3:.1f} ms"))
        rows.append(
            (
                "link for the budget",
                f"{plan.link_gbps_for_fraction:.1f} Gbit/s keeps the transfer under "
                f"{args.fraction:.0%} of prefill time",
            )
        )
    if plan.prefill_instances is not None and plan.prefill_instances_without_cache is not None:
        rows.append(
            (
                "prefill pool",
                f"{plan.prefill_instances:.2f} instances "
                f"({plan.prefill_instances_without_cache:.2f} without the "
                f"{traffic.hit_rate:.0%} cache hits)",
            )
        )
    if plan.decode_instances is not None:
        rows.append(("decode pool", f"{plan.decode_instances:.2f} instances"))
    if plan.prefill_to_decode is not None:
        rows.append(("prefill : decode", f"{plan.prefill_to_decode:.2f} : 1"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)
