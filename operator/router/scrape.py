"""The background reader of each replica's ``/metrics``: one round over the current replicas, then a
pause, so no replica is read more often than every ``interval_s`` and no request waits on a scrape.

Only what the scorer reads is parsed: the lines of other families are dropped before the text reaches
prometheus-client's parser (an engine's page is mostly histograms). The three gauges go through the
operator's own reader (``remediation.metrics.parse_scrape``), which validates them, deprecated names
included; so does ``kvpilot_config_info`` (the replica's ``max_num_seqs`` and step budget). The
replica's rates come from its step counters (kvpilot's ``kvpilot_engine_step_*``: seconds per prefill
token, seconds per decode step, and how the decode step grows with the batch, from the counters' batch
classes) over its recent work, decayed by half every ``RATE_HALF_LIFE_S``, and
pooled over the replicas (:func:`fleet_rates`); an engine without them (vLLM) gets its decode step
from ``vllm:inter_token_latency_seconds``' mean.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine import metrics_names as m
from kvpilot.operator.api import names
from kvpilot.operator.remediation.metrics import MetricsParseError, parse_scrape
from kvpilot.operator.router.scoring import EngineLoad

GAUGES = (m.NUM_REQUESTS_WAITING, m.NUM_REQUESTS_RUNNING, m.KV_CACHE_USAGE_PERC)
STEP_COUNTERS = (
    m.ENGINE_STEPS_TOTAL,
    m.ENGINE_STEP_SECONDS_TOTAL,
    m.ENGINE_STEP_TOKENS_TOTAL,
    m.ENGINE_STEP_SEQS_TOTAL,
)
ITL_PARTS = (m.INTER_TOKEN_LATENCY_SECONDS + "_sum", m.INTER_TOKEN_LATENCY_SECONDS + "_count")
PROMPT_PARTS = (m.REQUEST_PROMPT_TOKENS + "_sum", m.REQUEST_PROMPT_TOKENS + "_count")
# Prompt characters the door must have matched to engine-counted tokens before it trusts the ratio.
MIN_MATCHED_CHARS = 4096
# The families' names as exported, deprecated spellings included.
WANTED = (
    frozenset(GAUGES)
    | frozenset(a for a, c in m.DEPRECATED_ALIASES.items() if c in GAUGES)
    | {m.CONFIG_INFO, m.INTER_TOKEN_LATENCY_SECONDS, *ITL_PARTS, m.REQUEST_PROMPT_TOKENS, *PROMPT_PARTS}
    | frozenset(STEP_COUNTERS)
    | frozenset(c.removesuffix("_total") for c in STEP_COUNTERS)  # a counter's family in # TYPE
)
RATE_HALF_LIFE_S = 30.0  # a replica's rates weigh the work of the last half minute as much as all before
# Decayed decode steps a batch class needs before its mean step time enters the fit.
MIN_CLASS_STEPS = 3.0

# (batch class, decode seconds, decode steps, sequences in those steps), one per class, sorted.
DecodeClasses = tuple[tuple[str, float, float, float], ...]


@dataclasses.dataclass(frozen=True)
class Totals:
    """A replica's cumulative work counters at one scrape: prefill-phase seconds and tokens, decode-phase
    seconds and steps (kvpilot's step counters), the inter-token latency histogram's sum and count, and
    the prompt-token histogram's (vLLM's and kvpilot's: observed as a request ends). None: not exported
    or not a finite non-negative number."""

    prefill_seconds: float | None = None
    prefill_tokens: float | None = None
    decode_seconds: float | None = None
    decode_steps: float | None = None
    itl_sum: float | None = None
    itl_count: float | None = None
    prompt_tokens_sum: float | None = None
    prompt_tokens_count: float | None = None
    decode_classes: DecodeClasses = ()


def totals_of(text: str) -> Totals:
    """The work counters from the kept lines of a ``/metrics`` body (unparsable: no counters)."""
    sums: dict[tuple[str, str], float] = {}
    by_class: dict[tuple[str, str], float] = {}  # (counter, batch class) of decode steps
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in STEP_COUNTERS or sample.name in ITL_PARTS or sample.name in PROMPT_PARTS:
                    phase = sample.labels.get("phase", "")
                    key = (sample.name, phase)
                    sums[key] = sums.get(key, 0.0) + float(sample.value)
                    if phase == "decode" and m.LABEL_NUM_SEQS in sample.labels:
                        key = (sample.name, sample.labels[m.LABEL_NUM_SEQS])
                        by_class[key] = by_class.get(key, 0.0) + float(sample.value)
    except Exception:  # the parser raises ValueError, IndexError, ... on garbage
        return Totals()

    def get(name: str, phase: str = "") -> float | None:
        value = sums.get((name, phase))
        return value if value is not None and math.isfinite(value) and value >= 0 else None

    return Totals(
        prefill_seconds=get(m.ENGINE_STEP_SECONDS_TOTAL, "prefill"),
        prefill_tokens=get(m.ENGINE_STEP_TOKENS_TOTAL, "prefill"),
        decode_seconds=get(m.ENGINE_STEP_SECONDS_TOTAL, "decode"),
        decode_steps=get(m.ENGINE_STEPS_TOTAL, "decode"),
        itl_sum=get(ITL_PARTS[0]),
        itl_count=get(ITL_PARTS[1]),
        prompt_tokens_sum=get(PROMPT_PARTS[0]),
        prompt_tokens_count=get(PROMPT_PARTS[1]),
        decode_classes=_classes(by_class),
    )


def _classes(by_class: Mapping[tuple[str, str], float]) -> DecodeClasses:
    """Each batch class's decode (seconds, steps, sequences), for the classes that report all three
    as finite non-negative numbers."""
    out = []
    for batch in sorted({batch for _, batch in by_class}):
        values = [
            by_class.get((name, batch))
            for name in (m.ENGINE_STEP_SECONDS_TOTAL, m.ENGINE_STEPS_TOTAL, m.ENGINE_STEP_SEQS_TOTAL)
        ]
        if all(v is not None and math.isfinite(v) and v >= 0 for v in values):
            out.append((batch, *values))
    return tuple(out)


def _summed(*rows: Iterable[tuple[str, float, float, float]]) -> DecodeClasses:
    """Batch-class rows added up class by class, sorted by class."""
    sums: dict[str, list[float]] = {}
    for batch, *values in (row for group in rows for row in group):
        total = sums.setdefault(batch, [0.0, 0.0, 0.0])
        for i, value in enumerate(values):
            total[i] += value
    return tuple((batch, *sums[batch]) for batch in sorted(sums))


@dataclasses.dataclass(frozen=True)
class Work:
    """A replica's recent work, each sum decayed by half every ``RATE_HALF_LIFE_S``: prefill-phase
    seconds and tokens, decode-phase seconds and steps (or, without step counters, the inter-token
    latency's sum and count), and the decode steps by batch class (seconds, steps, sequences)."""

    prefill_seconds: float = 0.0
    prefill_tokens: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: float = 0.0
    decode_classes: DecodeClasses = ()

    def __add__(self, other: Work) -> Work:
        return Work(
            self.prefill_seconds + other.prefill_seconds,
            self.prefill_tokens + other.prefill_tokens,
            self.decode_seconds + other.decode_seconds,
            self.decode_steps + other.decode_steps,
            _summed(self.decode_classes, other.decode_classes),
        )

    def decode_line(self) -> tuple[float, float] | None:
        """How the decode step grows with the batch: (mean sequences per step, seconds per added
        sequence), a least-squares line through the batch classes' mean step times weighted by their
        steps, around the steps' mean. None with fewer than two classes of ``MIN_CLASS_STEPS``; a line
        that falls (noise) is taken as flat."""
        points = [
            (seqs / steps, seconds / steps, steps)
            for _, seconds, steps, seqs in self.decode_classes
            if steps >= MIN_CLASS_STEPS and seqs > 0
        ]
        if len({round(x, 6) for x, _, _ in points}) < 2:
            return None
        weight = sum(w for _, _, w in points)
        mean_x = sum(x * w for x, _, w in points) / weight
        mean_y = sum(y * w for _, y, w in points) / weight
        spread = sum(w * (x - mean_x) ** 2 for x, _, w in points)
        slope = sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points) / spread
        return mean_x, max(0.0, slope)

    @property
    def prefill_s_per_token(self) -> float | None:
        return self.prefill_seconds / self.prefill_tokens if self.prefill_tokens > 0 else None

    @property
    def decode_step_s(self) -> float | None:
        return self.decode_seconds / self.decode_steps if self.decode_steps > 0 else None


def _increase(after: float | None, before: float | None) -> float | None:
    """A counter's increase between two scrapes (None when missing or fallen: a restart)."""
    if after is None:
        return None
    increase = after - (before or 0.0)
    return increase if increase >= 0 else None


def _pair(after: Totals, before: Totals, names: tuple[str, str]) -> tuple[float, float]:
    """The increases of a (seconds, count) pair, (0, 0) unless both grew cleanly."""
    num = _increase(getattr(after, names[0]), getattr(before, names[0]))
    den = _increase(getattr(after, names[1]), getattr(before, names[1]))
    return (num, den) if num is not None and den is not None and den > 0 else (0.0, 0.0)


def updated_work(work: Work, after: Totals, before: Totals, elapsed_s: float) -> Work:
    """``work`` decayed over ``elapsed_s`` plus the counters' increase from ``before`` to ``after``."""
    keep = 0.5 ** (max(0.0, elapsed_s) / RATE_HALF_LIFE_S)
    prefill = _pair(after, before, ("prefill_seconds", "prefill_tokens"))
    decode = _pair(after, before, ("decode_seconds", "decode_steps"))
    if after.decode_steps is None:  # no step counters (vLLM): the mean inter-token time
        decode = _pair(after, before, ("itl_sum", "itl_count"))
    kept = [(batch, *(v * keep for v in values)) for batch, *values in work.decode_classes]
    earlier = {batch: values for batch, *values in before.decode_classes}
    grown = []
    for batch, *values in after.decode_classes:
        increases = [_increase(v, b) for v, b in zip(values, earlier.get(batch, (None,) * 3), strict=True)]
        if all(g is not None for g in increases):
            grown.append((batch, *increases))
    return Work(
        prefill_seconds=work.prefill_seconds * keep + prefill[0],
        prefill_tokens=work.prefill_tokens * keep + prefill[1],
        decode_seconds=work.decode_seconds * keep + decode[0],
        decode_steps=work.decode_steps * keep + decode[1],
        decode_classes=_summed(kept, grown),
    )


def _int_label(labels, name: str) -> int | None:
    try:
        value = int(labels.get(name, ""))
    except ValueError:
        return None
    return value if value > 0 else None


def _family_of(line: str) -> str:
    if line.startswith("#"):
        parts = line.split(None, 3)
        return parts[2] if len(parts) > 2 and parts[1] in ("HELP", "TYPE") else ""
    end = len(line)
    for stop in ("{", " "):
        found = line.find(stop)
        if found != -1:
            end = min(end, found)
    return line[:end]


def fleet_rates(loads: Mapping[str, EngineLoad], works: Iterable[Work]) -> dict[str, EngineLoad]:
    """``loads`` with every replica's rates replaced by the rates of all their recent work pooled.
    One InferenceService's replicas run one model under one configuration: what tells them apart is
    their queues, not their speed, and one replica's noisy interval must not send every request to
    it. A rate no replica measured yet is left as each load has it."""
    pool = Work()
    for work in works:
        pool = pool + work
    prefill, decode = pool.prefill_s_per_token, pool.decode_step_s
    line = pool.decode_line() if decode is not None else None
    return {
        url: dataclasses.replace(
            load,
            prefill_s_per_token=load.prefill_s_per_token if prefill is None else prefill,
            decode_step_s=load.decode_step_s if decode is None else decode,
            decode_mean_seqs=load.decode_mean_seqs if line is None else line[0],
            decode_step_per_seq_s=load.decode_step_per_seq_s if line is None else line[1],
        )
        for url, load in loads.items()
    }


@dataclasses.dataclass(frozen=True)
class Reading:
    """What one scrape of a replica left: the scorer's view, the raw counters and the recent work;
    ``ended``: the requests the door had seen end at that replica, and their prompts' characters (both
    cumulative); ``matched``: prompt tokens and characters over the intervals where the engine
    finished exactly the requests the door saw end (cumulative)."""

    load: EngineLoad
    totals: Totals
    work: Work
    ended: tuple[int, float] = (0, 0.0)
    matched: tuple[float, float] = (0.0, 0.0)


def _matched(before: Reading | None, totals: Totals, ended: tuple[int, float]) -> tuple[float, float]:
    """``before.matched`` plus this interval's prompt tokens and characters when the engine's count
    of finished requests grew by exactly the door's count of ended ones: then the tokens are those of
    the prompts the door sent (no other client's, none still in flight). Otherwise unchanged."""
    if before is None:
        return (0.0, 0.0)
    count = _increase(totals.prompt_tokens_count, before.totals.prompt_tokens_count)
    tokens = _increase(totals.prompt_tokens_sum, before.totals.prompt_tokens_sum)
    requests, chars = ended[0] - before.ended[0], ended[1] - before.ended[1]
    if count is None or tokens is None or requests <= 0 or count != requests or chars <= 0:
        return before.matched
    return (before.matched[0] + tokens, before.matched[1] + chars)


def tokens_per_char(readings: Iterable[Reading]) -> float | None:
    """Prompt tokens per character of the door's canonical prompt text, over every replica's matched
    intervals (one model, one tokenizer); None until ``MIN_MATCHED_CHARS`` were matched."""
    tokens = chars = 0.0
    for reading in readings:
        tokens += reading.matched[0]
        chars += reading.matched[1]
    return tokens / chars if chars >= MIN_MATCHED_CHARS and tokens > 0 else None


def engine_load(
    text: str,
    now: float,
    in_flight: int = 0,
    before: Reading | None = None,
    ended: tuple[int, float] = (0, 0.0),
) -> Reading | None:
    """The scorer's view of a replica from one ``/metrics`` body (None when a gauge is missing or
    invalid: the replica is then costed as if it had no scrape). ``now``, ``in_flight`` and ``ended``
    (the door's ended requests there and their prompt characters, cumulative) are recorded with it.
    ``before``: the previous scrape's reading, whose recent work the counters' increase since then
    updates (without one, everything counted since the start is the work)."""
    kept = "\n".join(line for line in text.splitlines() if _family_of(line) in WANTED) + "\n"
    try:
        scrape = parse_scrape(kept, now)
    except MetricsParseError:
        return None
    if scrape.waiting is None or scrape.running is None or scrape.kv_usage is None:
        return None
    totals = totals_of(kept)
    if before is None:
        work = updated_work(Work(), totals, Totals(), 0.0)
    else:
        work = updated_work(before.work, totals, before.totals, now - before.load.scraped_at)
    line = work.decode_line() if work.decode_step_s is not None else None
    load = EngineLoad(
        num_requests_waiting=scrape.waiting,
        num_requests_running=scrape.running,
        kv_cache_usage=scrape.kv_usage,
        scraped_at=now,
        in_flight_at_scrape=in_flight,
        max_num_seqs=_int_label(scrape.live_config, "max_num_seqs"),
        max_num_batched_tokens=_int_label(scrape.live_config, "max_num_batched_tokens"),
        prefill_s_per_token=work.prefill_s_per_token,
        decode_step_s=work.decode_step_s,
        decode_mean_seqs=None if line is None else line[0],
        decode_step_per_seq_s=None if line is None else line[1],
    )
    return Reading(load, totals, work, ended, _matched(before, totals, ended))


class MetricsScraper:
    """Reads ``/metrics`` of every URL ``endpoints()`` returns, every ``interval_s`` at most, into
    ``loads`` (URL -> :class:`EngineLoad`). ``in_flight(url)`` and ``ended(url)`` (the door's ended
    requests there and their prompt characters) are recorded with each scrape; ``on_refused(url)`` is
    called when a replica refuses the connection. ``errors`` counts failed scrapes per URL."""

    def __init__(
        self,
        endpoints: Callable[[], list[str]],
        in_flight: Callable[[str], int],
        *,
        ended: Callable[[str], tuple[int, float]] = lambda url: (0, 0.0),
        interval_s: float = 0.2,
        timeout_s: float = 1.0,
        on_refused: Callable[[str], None] = lambda url: None,
        logger: Any = None,
    ) -> None:
        self.endpoints = endpoints
        self.in_flight = in_flight
        self.ended = ended
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.on_refused = on_refused
        self.logger = logger
        self.loads: dict[str, EngineLoad] = {}
        self._readings: dict[str, Reading] = {}
        self.errors: Counter[str] = Counter()
        self.rounds = 0

    @property
    def tokens_per_char(self) -> float | None:
        """The replicas' prompt tokens per character of the door's prompt text, None until known."""
        return tokens_per_char(self._readings.values())

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Scrape until cancelled."""
        while True:
            urls = list(self.endpoints())
            for gone in set(self._readings) - set(urls):
                del self._readings[gone]
            await asyncio.gather(*(self._one(session, url) for url in urls))
            current = [self._readings[url] for url in urls if url in self._readings]
            self.loads = fleet_rates(
                {url: self._readings[url].load for url in urls if url in self._readings},
                (reading.work for reading in current),
            )
            self.rounds += 1
            await asyncio.sleep(self.interval_s)

    async def _one(self, session: aiohttp.ClientSession, url: str) -> None:
        try:
            async with session.get(url + names.METRICS_PATH, timeout=self.timeout) as response:
                text = await response.text() if response.status == 200 else None
        except aiohttp.ClientConnectorError:
            self.errors[url] += 1
            self.on_refused(url)
            return
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.errors[url] += 1
            if self.logger is not None:
                self.logger.debug(f"router: scraping {url} failed ({exc!r})")
            return
        before = self._readings.get(url)
        now, in_flight, ended = time.monotonic(), self.in_flight(url), self.ended(url)
        read = None if text is None else engine_load(text, now, in_flight, before, ended)
        if read is None:
            self.errors[url] += 1
            return
        self._readings[url] = read
