"""``kvbridge hash`` and ``kvbridge check``: small tools around the store."""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any

import lmdb

from kvbridge.store import KEY_BYTES, StoreError, TieredStore, prefix_hashes

from ._fail import fail

_TOKEN_ID = re.compile(r"^-?[0-9]+$")


def _token_id(text: str) -> int:
    """A token id as typed: ASCII digits only (``int()`` would also take ``+7``, ``1_0``
    and other scripts' digits); a negative one is left for ``prefix_hashes`` to refuse."""
    if not _TOKEN_ID.match(text):
        raise argparse.ArgumentTypeError(f"not a token id (a whole number >= 0): {text!r}")
    return int(text)


def add_parsers(commands: Any) -> None:
    hashing = commands.add_parser("hash", help="print the chained prefix keys of a token sequence")
    hashing.add_argument("tokens", nargs="+", type=_token_id, help="token ids")
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
        return fail("kvbridge hash", exc)
    for key in keys:
        print(key.hex())
    return 0


def _run_check(args: argparse.Namespace) -> int:
    data_file = os.path.join(args.path, "data.mdb")
    if not os.path.isfile(data_file):
        return fail("kvbridge check", f"no disk tier at {args.path}")
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
        return fail("kvbridge check", exc)
    except lmdb.Error as exc:  # the disk tier's own file is damaged beyond what check reads
        return fail("kvbridge check", f"{args.path}: damaged disk tier: {exc}")
    summary = {
        "blocks": report.blocks,
        "corrupt": len(report.corrupt),
        "orphans": len(report.orphans),
        "repaired": report.repaired,
        "ok": report.ok,
    }
    print(json.dumps(summary))
    return 0 if report.ok or report.repaired else 1
