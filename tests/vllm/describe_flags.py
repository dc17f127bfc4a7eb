"""Run by vLLM's own interpreter: describe every option of ``vllm serve``'s parser.

Writes one JSON object to stdout, option string -> ``{"dest", "takes_value", "default", "choices"}``
(``default`` as ``repr`` so None, booleans and suppressed defaults stay distinct).
"""

from __future__ import annotations

import contextlib
import io
import json

from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser


def main() -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        parser = make_arg_parser(FlexibleArgumentParser())
    options = {}
    for action in parser._actions:
        for option in action.option_strings:
            options[option] = {
                "dest": action.dest,
                "takes_value": action.nargs != 0,
                "default": repr(action.default),
                "choices": sorted(map(str, action.choices)) if action.choices else None,
            }
    print(json.dumps(options))


if __name__ == "__main__":
    main()
