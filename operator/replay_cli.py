"""``kvpilot replay``: recorded engine metrics through the remediation policy, decision by decision.

Registered by :func:`kvpilot.operator.cli.add_parser` with ``kvpilot operator`` and ``kvpilot render``.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvpilot.operator.cli import positive_seconds, read_one_inference_service


def add_replay_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``replay`` subcommand to the ``kvpilot`` parser."""
    replay = subparsers.add_parser(
        "replay",
        help="replay recorded engine metrics through the remediation policy",
        description="Feed recorded scrapes (JSON Lines, as `kvpilot operator --record` writes them) through "
        "the remediation policy for an InferenceService and print each decision with its reason. The metrics "
        "play back as recorded; the policy's own decisions update the effective configuration, the history "
        "and the cooldown as they would live.",
    )
    replay.add_argument("-f", "--filename", required=True, metavar="FILE", help="InferenceService manifest")
    replay.add_argument(
        "--metrics", required=True, metavar="SAMPLES", help="samples file (JSON Lines), or - for stdin"
    )
    replay.add_argument(
        "--output", choices=["table", "json"], default="table", help="table (default) or one JSON line each"
    )
    replay.add_argument(
        "--mode",
        choices=["Auto", "Recommend", "Off"],
        default=None,
        help="replay as if spec.remediation.mode were this (default: the manifest's); "
        "--mode Auto answers 'what would Auto have done?'",
    )
    replay.add_argument(
        "--stale-after",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="a pod's metrics are stale after this long without a sample (default: 3 scrape intervals)",
    )
    replay.add_argument(
        "--changes-only", action="store_true", help="table output: only evaluations that change something"
    )
    paths = replay.add_mutually_exclusive_group()
    paths.add_argument(
        "--no-plan",
        action="store_true",
        help="the ladder alone: replay as if spec.remediation.plan.enabled were false",
    )
    paths.add_argument(
        "--both-paths",
        action="store_true",
        help="replay twice, with the plan and with the ladder alone, and print both (JSON lines carry "
        '"run": "plan" or "ladder")',
    )
    replay.set_defaults(func=run_replay)


def run_replay(args: argparse.Namespace) -> int:
    """``kvpilot replay -f ISVC --metrics SAMPLES``: 0 and the decisions on stdout, or 1 and why not."""
    from kvpilot.operator.remediation.replay import (
        ReplayError,
        compare_paths,
        format_table,
        read_records,
        replay,
        summary,
    )

    isvc = read_one_inference_service(args.filename)
    if isvc is None:
        return 1
    runs = [(None, False if args.no_plan else None)]
    if args.both_paths:
        runs = [("plan", True), ("ladder", False)]
    try:
        if args.metrics == "-":
            records = read_records(sys.stdin, isvc)
        else:
            with open(args.metrics, encoding="utf-8") as handle:
                records = read_records(handle, isvc)
        results = []
        for run, plan in runs:
            rows = []
            decisions = []
            timed = []
            final = isvc
            replayed = replay(isvc, records, mode=args.mode, stale_after_s=args.stale_after, plan=plan)
            for time_, decision, state in replayed:
                final = state
                decisions.append(decision)
                timed.append((time_, decision))
                if args.output == "json":
                    line = decision.to_json(time_)
                    print(json.dumps(line if run is None else {"run": run, **line}), flush=False)
                elif decision.is_change or not args.changes_only:
                    rows.append((time_, decision))
            results.append((run, rows, decisions, final, timed))
    except OSError as exc:
        print(f"error: cannot read {args.metrics}: {exc}", file=sys.stderr)
        return 1
    except ReplayError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.output == "table":
        for run, rows, decisions, final, _ in results:
            if run is not None:
                print(f"== {'with the plan' if run == 'plan' else 'the ladder alone (plan disabled)'} ==")
            print(format_table(rows))
            print(summary(decisions, final))
        if args.both_paths:
            print(compare_paths(results[0][4], results[1][4]))
    return 0
