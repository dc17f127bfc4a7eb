"""The ``kvpilot`` command. Each room registers its own subcommands; imports stay lazy so that
``kvpilot operator`` never loads torch and ``kvpilot serve`` never loads kopf.

A subcommand that needs an optional extra checks for it before anything of it is imported: without
it, one line on stderr names the extra to install and the exit code is 1.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import signal
import sys
from collections.abc import Iterable

# subcommand -> module exposing ``add_parser(subparsers)``; the parser sets ``func`` (args -> exit code).
SUBCOMMANDS = {
    "serve": "kvpilot.engine.server.cli",
    "operator": "kvpilot.operator.cli",
    "render": "kvpilot.operator.cli",
    "replay": "kvpilot.operator.cli",
    "plan": "kvpilot.operator.plan.cli",
    "up": "kvpilot.operator.local.platform",
    "router": "kvpilot.operator.router.cli",
}

# The import names of the engine extra's packages (pyproject's optional-dependencies).
_ENGINE_MODULES = (
    "torch",
    "numpy",
    "transformers",
    "tokenizers",
    "safetensors",
    "tqdm",
    "fastapi",
    "uvicorn",
)
# subcommand -> (the extras it needs, the modules they provide that it imports). `render` and `replay`
# need none: PyYAML and prometheus-client are base dependencies.
REQUIRED_EXTRAS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "serve": (("engine",), _ENGINE_MODULES),
    "operator": (("operator",), ("kopf", "aiohttp")),
    # The front door and the scrapes use aiohttp; every replica is a `kvpilot serve` process.
    "up": (("engine", "operator"), ("aiohttp", *_ENGINE_MODULES)),
    # The scoring front door: aiohttp for the proxy and the scrapes, no engine.
    "router": (("operator",), ("aiohttp",)),
}


def missing_modules(modules: Iterable[str]) -> list[str]:
    """The names in ``modules`` that cannot be imported here (found without importing them)."""
    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a finder that refuses the name; a half-initialised module
            found = False
        if not found:
            missing.append(name)
    return missing


def missing_extras_message(command: str) -> str | None:
    """None when ``command`` has what it needs; otherwise the one line naming the extra(s) to install,
    e.g. ``kvpilot serve needs the engine extra: pip install 'kvpilot[engine]' (missing: uvicorn)``."""
    extras, modules = REQUIRED_EXTRAS.get(command, ((), ()))
    missing = missing_modules(modules)
    if not missing:
        return None
    which = f"the {extras[0]} extra" if len(extras) == 1 else f"the {' and '.join(extras)} extras"
    return (
        f"kvpilot {command} needs {which}: pip install 'kvpilot[{','.join(extras)}]' "
        f"(missing: {', '.join(missing)})"
    )


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


def exit_cleanly_on_sigterm() -> None:
    """SIGTERM exits 0 until the command installs its own handlers: a pod stopped while its process is
    still importing has nothing to clean up, and a kill by the signal's default action would read as a
    failure (exit 143)."""

    def stop(signum, frame) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "operator":
        exit_cleanly_on_sigterm()
    problem = missing_extras_message(argv[0]) if argv else None
    if problem is None and argv and argv[0] in SUBCOMMANDS and missing_modules([SUBCOMMANDS[argv[0]]]):
        # The slim operator image leaves out the local platform (and the demo) on purpose.
        problem = f"kvpilot {argv[0]} is not part of this installation ({SUBCOMMANDS[argv[0]]} is absent)"
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
