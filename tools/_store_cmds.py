"""``kvbridge hash`` and ``kvbridge check``: small tools around the store."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from kvbridge.store import KEY_BYTES, StoreError, TieredStore, prefix_hashes


def add_parsers(commands: Any) -> None:
    hashing = commands.add_parser("hash", help="print the chained prefix keys of a token sequence")
    hashing.add_argument("tokens", nargs="+", type=int, help="token ids")
    hashing.add_argument("--block-tokens", type=int, default=16)
    hashing.add_argument("--namespace", default="")
    hashing.add_argument("--algo", choices=sorted(KEY_BYTES), default="blake3")
    hashing.set_defaults(run=_run_hash)

    check = commands.add_parser(
        "check", help="verify every block of a disk tier against its checksum"
    )
    check.add_argument("path", help="the disk tier's directory")
    check.add_argument("--block-bytes", type=int, required=True)
    check.add_argument("--namespace", default="")
    check.add_argument("--repair", action="store_true", help="drop the blocks that fail")
    check.set_defaults(run=_run_check)


def _run_hash(args: argparse.Namespace) -> int:
    try:
        keys = prefix_hashes(
            args.tokens, args.block_tokens, namespace=args.namespace, algo=args.algo
        )
    except (StoreError, ValueError) as exc:
        print(f"kvbridge hash: {exc}", file=sys.stderr)
        return 2
    for key in keys:
        print(key.hex())
    return 0


def _run_check(args: argparse.Namespace) -> int:
    data_file = os.path.join(args.path, "data.mdb")
    if not os.path.isfile(data_file):
        print(f"kvbridge check: no disk tier at {args.path}", file=sys.stderr)
        return 2
    try:
        # Capacity only bounds the map; a reopen never trims below what is stored here.
        with TieredStore(
            args.block_bytes,
            host_capacity=0,
            disk_path=args.path,
            disk_capacity=max(os.path.getsize(data_file), args.block_bytes),
            namespace=args.namespace,
        ) as store:
            report = store.check(repair=args.repair)
    except (StoreError, ValueError, OSError) as exc:
        print(f"kvbridge check: {exc}", file=sys.stderr)
        return 2
    summary = {
        "blocks": report.blocks,
        "corrupt": len(report.corrupt),
        "orphans": len(report.orphans),
        "repaired": report.repaired,
        "ok": report.ok,
    }
    print(json.dumps(summary))
    return 0 if report.ok or report.repaired else 1
