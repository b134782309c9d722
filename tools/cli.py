"""The ``kvbridge`` command: one subcommand per job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvbridge import __version__

from . import _bench, _demo, _linkcheck, _plan, _replay, _serve_cmds, _store_cmds


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvbridge",
        description="KV-cache transfer engine and tiered cache store for disaggregated serving.",
    )
    parser.add_argument("--version", action="version", version=f"kvbridge {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _demo.add_parser(commands)
    _store_cmds.add_parsers(commands)
    _serve_cmds.add_parsers(commands)
    _replay.add_parser(commands)
    _plan.add_parser(commands)
    _bench.add_parser(commands)
    _linkcheck.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    status: int = args.run(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
