"""A per-request trace (``kvpilot serve --request-trace``) as the plan's arrivals, in place of the
distributions the recording's histograms give (torch-free, like the rest of the plan)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence

from kvpilot.operator.plan.recording import PlanScrape, RecordingError, segment_spans
from kvpilot.operator.plan.simulate import Arrival
from kvpilot.operator.plan.workload import Workload


def read_trace(
    paths: Sequence[str], start: float, end: float, spans: Sequence[tuple[float, float, float]] = ()
) -> tuple[Arrival, ...]:
    """The requests of ``kvpilot serve --request-trace`` files (one per pod) that arrived between
    ``start`` and ``end`` (unix seconds: the recording's span), as arrivals from ``start``. With
    ``spans`` (recordings laid end to end: each one's first and last scrape as recorded, and the
    seconds it was moved by; ``recording.segment_spans``), those that arrived within a span, moved as
    its recording was, ``start`` and ``end`` then on the moved clock. A request
    whose prompt hit the prefix cache (``cached_tokens``) starts with a prefix of that length that
    every such request shares (the first request of a prefix, which found nothing cached, holds it
    only as its own). Raises RecordingError (one line) for a file that cannot be read or holds no
    such request."""
    out = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as handle:
                for number, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    try:
                        item = json.loads(line)
                        arrival = float(item["arrival"])
                        prompt, output = int(item["prompt_tokens"]), int(item["output_tokens"])
                        cached = int(item.get("cached_tokens") or 0)
                    except (ValueError, KeyError, TypeError) as exc:
                        raise RecordingError(
                            f"{path}: line {number}: not a request trace line ({exc})"
                        ) from exc
                    if spans:
                        moved = [arrival + shift for lo, hi, shift in spans if lo <= arrival <= hi]
                        arrival = moved[0] if moved else math.nan
                    if start <= arrival <= end and prompt >= 1:
                        shared = max(0, min(cached, prompt - 1))
                        out.append(
                            Arrival(
                                arrival - start,
                                prompt,
                                max(1, output),
                                prefix_group=0 if shared else None,
                                prefix_len=shared,
                            )
                        )
        except OSError as exc:
            raise RecordingError(f"cannot read the request trace {path}: {exc}") from exc
    if not out:
        raise RecordingError(f"no request of the trace arrived within the recording ({start:.0f}-{end:.0f})")
    return tuple(sorted(out, key=lambda a: a.time))


def with_trace(workload: Workload, scrapes: Sequence[PlanScrape], paths: Sequence[str]) -> Workload:
    """``workload`` with its arrivals taken from the request trace files ``paths``, and, for a recording
    of one pod, the times of its scrapes on the same clock (``Workload.scrape_times``): a request that
    met a scrape's render meets it again in the simulation. With several pods each was scraped at times
    of its own, and the simulated replica's are drawn as without a trace."""
    start = min(s.time for s in scrapes)
    end = max(s.time for s in scrapes)
    spans = segment_spans(scrapes)
    trace = read_trace(paths, start, end, spans if len(spans) > 1 else ())
    one_pod = len({s.pod for s in scrapes}) == 1
    # Recordings laid end to end join where one's last scrape and the next one's first meet: one scrape.
    times = tuple(sorted({s.time - start for s in scrapes})) if one_pod else ()
    return dataclasses.replace(workload, trace=trace, scrape_times=times)
