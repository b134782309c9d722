"""The ``kvbridge`` command: one subcommand per job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from kvbridge import __version__

from . import (
    _bench,
    _demo,
    _events_cmd,
    _linkcheck,
    _plan,
    _proxy,
    _replay,
    _serve_cmds,
    _store_cmds,
)
from ._fail import fail, unexpected

INTERRUPTED = 130
"""Exit status after Ctrl-C: 128 + SIGINT, as a shell reports it."""


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (``kvbridge hash: error: ...``), exit status 2; subcommand
    parsers are of this class too (``add_subparsers`` uses the parent's class)."""

    def error(self, message: str) -> NoReturn:
        fail(f"{self.prog}: error", f"{message} (see {self.prog} --help)")
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvbridge",
        description="KV-cache transfer engine and tiered cache store for disaggregated serving.",
    )
    parser.add_argument("--version", action="version", version=f"kvbridge {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _demo.add_parser(commands)
    _store_cmds.add_parsers(commands)
    _serve_cmds.add_parsers(commands)
    _events_cmd.add_parser(commands)
    _replay.add_parser(commands)
    _plan.add_parser(commands)
    _bench.add_parser(commands)
    _linkcheck.add_parser(commands)
    _proxy.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status. Whatever a subcommand raises ends as
    one line on stderr: status 1 for an unexpected error, 130 for Ctrl-C."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        status: int = args.run(args)
    except KeyboardInterrupt:
        return fail("kvbridge", "interrupted", INTERRUPTED)
    except Exception as exc:  # the safety net: a bug still reads as one line
        return unexpected(exc)
    return status


if __name__ == "__main__":
    sys.exit(main())
