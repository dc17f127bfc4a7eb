"""``python -m kvpilot.operator operator|render ...``: the operator's commands without the engine's."""

from __future__ import annotations

import argparse
import sys

from kvpilot.cli import exit_cleanly_on_sigterm


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the process arguments) and run the chosen subcommand."""
    from kvpilot.operator.cli import add_parser

    parser = argparse.ArgumentParser(prog="python -m kvpilot.operator")
    add_parser(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    exit_cleanly_on_sigterm()  # before the operator's imports (kopf, aiohttp), which take the longest
    sys.exit(main())
