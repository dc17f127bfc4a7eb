"""Run by vLLM's own interpreter: parse argument lists with ``vllm serve``'s parser.

Reads a JSON list of argument lists on stdin and writes one JSON object per list: ``{"ok": true,
"values": {...}}`` with the parsed values the tests check, or ``{"ok": false, "error": "..."}`` with
the parser's message. One process parses them all (building vLLM's parser takes seconds).
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

CHECKED = (
    "model",
    "host",
    "port",
    "served_model_name",
    "download_dir",
    "block_size",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "num_gpu_blocks_override",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "enable_chunked_prefill",
    "enable_prefix_caching",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "dtype",
    "kv_cache_dtype",
    "seed",
)


def main() -> None:
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    results = []
    for args in json.load(sys.stdin):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                ns = parser.parse_args(args)
        except SystemExit:
            lines = [line for line in err.getvalue().splitlines() if "error:" in line]
            results.append({"ok": False, "error": lines[-1] if lines else err.getvalue()[-500:]})
            continue
        results.append({"ok": True, "values": {k: getattr(ns, k, None) for k in CHECKED}})
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
