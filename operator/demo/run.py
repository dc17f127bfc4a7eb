"""``make demo``: the whole loop on one machine, from a preemption storm to the remediation that ends it.

    python -m kvpilot.operator.demo.run [--model DIR] [--out build/demo] [--quick]

1. A model: ``--model DIR`` (``MODEL=`` in make), else a small random-weight checkpoint built once into
   ``--out`` (``kvpilot.engine.models.synthetic``; ``--quick``: the tiny test size).
2. Calibration: one probe ``kvpilot serve`` reports what weights and activations take; from it the demo
   picks ``cpuMemoryBudgetBytes`` and ``gpuMemoryUtilization`` so that the KV pool holds ~14 blocks while
   the load needs 8 x 7 = 56, and one 0.05 step of the memory fraction makes room for all of it. On CPU
   the fraction is of that budget, so the lever is real.
3. ``kvpilot up -f inferenceservice.yaml --local`` (written to ``--out``) runs it: remediation ``Auto``,
   a short window, ``maxSurge: 1`` so the restart drops no request.
4. A bounded load (8 streaming clients through the front door) while the terminal shows replicas,
   preemptions/s, KV usage, the queue and every remediation with its reason. With live levers (the
   default) the storm is relieved in place first (``relieveMaxNumSeqs``, no restart), the restart lever
   ``raiseGpuMemoryUtilization`` follows one cooldown later, and ``restoreMaxNumSeqs`` ends the relief
   once that rolled out; ``--no-live`` (``spec.remediation.liveLevers: false``) runs the restart path
   alone, for comparison.
5. Once no relief is in force and the last configuration served a settled stretch: Ctrl-C to
   ``kvpilot up`` (no process may outlive it), a summary (storm -> relief time and how it was applied,
   the restart lever's rollout time, requests completed meanwhile, before/after preemption rate,
   throughput, TTFT p50/p99) and a timeline plot (``timeline.png``, with ``summary.json``).

Exit status 0 only when the loop really ran: a remediation was applied, the preemption rate fell below
the storm threshold, and every process stopped. ``KVPILOT_DEMO_QUICK=1`` is ``--quick`` (CI).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from kvpilot.operator.api import names
from kvpilot.operator.api.timefmt import parse_time
from kvpilot.operator.demo.live import HEADER, Load, Monitor, live_line
from kvpilot.operator.demo.prepare import (
    CONCURRENCY,
    PROMPT_LEN,
    THRESHOLD,
    calibrate,
    ensure_model,
    start_process,
    stop_process,
    wait_for_line,
    write_manifest,
)
from kvpilot.operator.demo.report import (
    compare_runs,
    comparison_row,
    summarize_run,
    write_plot,
)
from kvpilot.operator.remediation.decision import RELIEVE_MAX_NUM_SEQS

URL_LINE = re.compile(r"OpenAI API on (http://\S+)/v1")


@dataclasses.dataclass(frozen=True)
class Scenario:
    """Timings of one run (seconds)."""

    size: str  # synthetic checkpoint size when no model is given
    window_s: int
    cooldown_s: int
    after_s: float  # load on the new configuration before stopping
    storm_timeout_s: float  # no remediation by then: the demo failed
    rollout_timeout_s: float
    report_every_s: float = 2.0


FULL = Scenario("10m", window_s=12, cooldown_s=30, after_s=20, storm_timeout_s=150, rollout_timeout_s=150)
QUICK = Scenario("test", window_s=6, cooldown_s=10, after_s=8, storm_timeout_s=90, rollout_timeout_s=90)


def say(text: str = "") -> None:
    print(text, flush=True)


# --- 4. load and live view (the clients, the sampler and the table: live.py) ---------------------


async def drive(
    url: str, model_name: str, vocab: int, max_tokens: int, scenario: Scenario
) -> tuple[Monitor, Load, dict]:
    """Load the platform until a remediation has run, no live relief is in force, every rollout is
    complete and the configuration served ``after_s``."""
    t0 = time.time()
    load = Load(url, model_name, vocab, max_tokens)
    monitor = Monitor(url, t0)
    marks: dict[str, float] = {"load_start": t0}
    seen = 0
    load_task = asyncio.create_task(load.run())
    say()
    say(HEADER)
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        next_report = t0 + scenario.report_every_s
        while True:
            await asyncio.sleep(1.0)
            sample = await monitor.sample(session)
            now = time.time()
            if sample is not None and now >= next_report:
                recent = [s for s in monitor.timeline.samples if s.time >= now - 3.0]
                say(live_line(sample, t0, load, recent))
                next_report += scenario.report_every_s
            changes = monitor.remediations()
            for change in changes[seen:]:
                what = f"{change['field']} {change['from']:g} -> {change['to']:g}"
                how = change.get("appliedBy") or "rollout"
                path = f", path {change['path']}" if change.get("path") else ""
                say(f"  >> remediation {change['lever']}: {what} (applied by {how}{path})")
                say(f"     reason: {change['reason']}")
                at = _change_time(change, now)
                monitor.timeline.changes.append({**change, "t": at - t0, "at": at})
                marks.setdefault("remediation", at)
                marks["last_change"] = now
                if how != "live":
                    marks.pop("rolled_out", None)
                    marks["rollout_change"] = at
                marks.pop("settled", None)
            seen = len(changes)
            if "remediation" not in marks:
                if now - t0 > scenario.storm_timeout_s:
                    say(f"no remediation within {scenario.storm_timeout_s:.0f}s")
                    break
                continue
            if "rollout_change" in marks and "rolled_out" not in marks:
                if monitor.rolled_out():
                    marks["rolled_out"] = now
                    say(f"  >> rollout complete: every replica runs the new configuration ({now - t0:.0f}s)")
                elif now - marks["rollout_change"] > scenario.rollout_timeout_s:
                    say(f"the new configuration did not roll out within {scenario.rollout_timeout_s:.0f}s")
                    break
                continue
            seqs_changes = [c for c in changes if c["field"] == "maxNumSeqs"]
            if seqs_changes and seqs_changes[-1]["lever"] == RELIEVE_MAX_NUM_SEQS:
                # A live relief is in force: the restart lever follows it, then restoreMaxNumSeqs ends it.
                if now - marks["last_change"] > 2 * scenario.cooldown_s + scenario.rollout_timeout_s:
                    say("the live relief did not end (no restart lever, or no restoreMaxNumSeqs, in time)")
                    break
                continue
            marks.setdefault("settled", now)
            if now - marks["settled"] >= scenario.after_s:
                # Calm: done. A storm again (the ladder's rung was not enough): the next change is one
                # cooldown and a window away; wait for it, within bounds.
                recent = [x for x in monitor.timeline.samples if x.time > now - scenario.after_s]
                span = recent[-1].time - recent[0].time if len(recent) > 1 else 0.0
                rate = sum(x.preemptions for x in recent[1:]) / span if span else 0.0
                if rate < THRESHOLD:
                    break
                if now - marks["settled"] > scenario.after_s + 2 * scenario.cooldown_s + scenario.window_s:
                    say(f"the storm came back ({rate:.1f} preemptions/s) and no further change ended it")
                    break
    load.stopping.set()
    try:
        await asyncio.wait_for(load_task, timeout=30)
    except TimeoutError:
        load_task.cancel()
    marks["end"] = time.time()
    return monitor, load, marks


# --- 3. and 5.: run it -------------------------------------------------------------------------


def _change_time(change: dict[str, Any], fallback: float) -> float:
    """When the operator made a change (its status entry), else when the monitor saw it."""
    try:
        return min(parse_time(change["time"]), fallback)
    except (KeyError, TypeError, ValueError):
        return fallback


def _pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"kvpilot" in cmdline:
            alive.append(pid)
    return alive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvpilot.operator.demo.run", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default=os.environ.get("MODEL") or None, help="Hugging Face model dir")
    parser.add_argument("--out", type=Path, default=Path("build/demo"), help="cache and results")
    quick = os.environ.get("KVPILOT_DEMO_QUICK") == "1"
    parser.add_argument("--quick", action="store_true", default=quick, help="a short run (CI)")
    parser.add_argument(
        "--no-live",
        dest="live",
        action="store_false",
        help="every change rolls out (spec.remediation.liveLevers: false): the restart path alone",
    )
    paths = parser.add_mutually_exclusive_group()
    paths.add_argument(
        "--no-plan",
        dest="plan",
        action="store_false",
        help="the ladder alone (spec.remediation.plan.enabled: false): one 0.05 rung per cooldown",
    )
    paths.add_argument(
        "--compare",
        action="store_true",
        help="run twice, with the plan then with the ladder alone (--no-plan), and print them side by side",
    )
    args = parser.parse_args(argv)
    scenario = QUICK if args.quick else FULL
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    began = time.time()

    model = ensure_model(args.model, out, scenario.size)
    say(f"model: {model}")
    say("calibrating: one probe engine measures what weights and activations take...")
    cal = calibrate(model, out)
    blocks = cal["expected_blocks"]
    above = f"{cal['fits_above_start']:g}" if cal["fits_above_start"] is not None else "more than 1"
    say(
        f"KV pool: cpuMemoryBudgetBytes {cal['budget']:,} x gpuMemoryUtilization {cal['fraction']:g} leaves "
        f"~{blocks[0]} blocks of 16 tokens; {CONCURRENCY} streams need {cal['load_blocks']} (the fraction "
        f"{above} higher); one 0.05 step gives ~{blocks[1]}, two ~{blocks[2]}; limit {cal['max_fraction']:g}"
    )
    if not args.compare:
        result = run_once(model, out, cal, scenario, args.live, args.plan, began)
        return 0 if result["passed"] else 1
    results = {}
    for name, plan in (("plan", True), ("ladder", False)):
        say()
        say(f"=== {name}: spec.remediation.plan.enabled {str(plan).lower()} ===")
        results[name] = run_once(model, out / name, cal, scenario, args.live, plan, time.time())
    table = compare_runs(results, THRESHOLD)
    (out / "compare.json").write_text(
        json.dumps({k: comparison_row(v, THRESHOLD) for k, v in results.items()})
    )
    say()
    say(table)
    passed = all(r["passed"] for r in results.values())
    say(f"total {time.time() - began:.0f}s; " + ("PASS: the loop closed both ways" if passed else "FAIL"))
    return 0 if passed else 1


def run_once(
    model: Path, out: Path, cal: dict[str, Any], scenario: Scenario, live: bool, plan: bool, began: float
) -> dict[str, Any]:
    """One run of the loop (steps 3-5) into ``out``: its summary (``passed``: the loop closed and every
    process stopped)."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model / "config.json").read_text())
    manifest = out / "inferenceservice.yaml"
    isvc = write_manifest(manifest, model, cal, scenario.window_s, scenario.cooldown_s, live, plan)
    say(f"starting: kvpilot up -f {manifest} --local")
    up_log = out / "kvpilot-up.log"
    command = [sys.executable, "-m", "kvpilot.cli", "up", "-f", str(manifest), "--local", "--port", "0"]
    command += ["--scrape-interval", "1", "--status-interval", "5", "--log-dir", str(out / "logs")]
    command += ["--record", str(out / "scrapes.jsonl")]  # for kvpilot replay / kvpilot plan
    (out / "scrapes.jsonl").unlink(missing_ok=True)
    up = start_process(command, up_log, new_session=False)  # same process group: Ctrl-C reaches it too
    monitor = load = None
    marks: dict[str, float] = {}
    try:
        url = wait_for_line(up, up_log, URL_LINE, 60)
        say(f"front door: {url}/v1 (OpenAI API), live state: {url}/local/status")
        deadline = time.monotonic() + 180
        while not _healthy(url):
            if up.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"error: no replica became ready; see {up_log} and {out / 'logs'}")
            time.sleep(0.5)
        say(
            f"replica ready ({time.time() - began:.0f}s since start); load: {CONCURRENCY} streaming clients, "
            f"{PROMPT_LEN}-token prompts, {cal['max_tokens']} tokens each"
        )
        vocab = min(int(config.get("vocab_size", 1000)), 1000)
        name = isvc["spec"]["model"]["name"]
        monitor, load, marks = asyncio.run(drive(url, name, vocab, cal["max_tokens"], scenario))
    except KeyboardInterrupt:
        say("\ninterrupted: stopping kvpilot up")
        stop_process(up, signal.SIGINT, 30)
        raise SystemExit(130) from None
    finally:
        pids = [r["pid"] for r in (monitor.status.get("replicas", []) if monitor else []) if r.get("pid")]
        code = stop_process(up, signal.SIGINT, 40)  # what Ctrl-C does
    orphans = _pids_alive(pids)
    say(f"stopped kvpilot up (exit code {code}); engine processes left: {len(orphans)}")
    result = summarize_run(monitor.timeline, load.trips, load.refused, marks, THRESHOLD, cal)
    result.update(clean_exit=code == 0, orphans=orphans, elapsed_s=round(time.time() - began, 1))
    result.update(live_levers=live, plan_enabled=plan)
    result["passed"] = bool(result["loop_closed"] and code == 0 and not orphans)
    if result["loop_closed"] and not result["passed"]:
        result["why_not"] = f"kvpilot up exited with {code}" if code else f"processes left: {orphans}"
    png = write_plot(monitor.timeline, marks, THRESHOLD, out / "timeline.png")
    result["timeline_png"] = str(png) if png else None
    phases = {k: round(v - marks["load_start"], 2) for k, v in marks.items()}
    details = {**result, "marks_s": phases, "timeline": monitor.timeline.to_json()}
    (out / "summary.json").write_text(json.dumps(details, indent=1))
    say()
    say(result["text"])
    no_plot = "matplotlib is not installed (pip install -e '.[demo]')"
    say(f"timeline plot: {png or no_plot}")
    say(f"numbers: {out / 'summary.json'}; logs: {up_log}, {out / 'logs'}")
    say("PASS: the loop closed" if result["passed"] else "FAIL: " + result["why_not"])
    return result


def _healthy(url: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url + names.HEALTH_PATH, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


if __name__ == "__main__":
    sys.exit(main())
