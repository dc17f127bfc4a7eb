"""The ``kvpilot`` command. Each room registers its own subcommands; imports stay lazy so that
``kvpilot operator`` never loads torch and ``kvpilot serve`` never loads kopf."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing ``add_parser(subparsers)``; the parser sets ``func`` (args -> exit code).
SUBCOMMANDS = {
    "serve": "kvpilot.engine.server.cli",
    "operator": "kvpilot.operator.cli",
    "render": "kvpilot.operator.cli",
    "replay": "kvpilot.operator.cli",
    "up": "kvpilot.operator.local.platform",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpilot",
        description="Paged-attention LLM serving engine and the Kubernetes operator that tunes it.",
    )
    from kvpilot import __version__

    parser.add_argument("--version", action="version", version=f"kvpilot {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only the module of the chosen subcommand is imported (keeps start-up light); the other names
    # get hidden placeholders so that `kvpilot --help` still parses.
    wanted = SUBCOMMANDS.get(argv[0]) if argv else None
    loaded = set()
    for name, module_name in SUBCOMMANDS.items():
        if wanted is not None and module_name != wanted:
            subparsers.add_parser(name, help=argparse.SUPPRESS)
            continue
        if module_name in loaded:
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue  # that room's extra is not installed in this image
        module.add_parser(subparsers)
        loaded.add(module_name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
