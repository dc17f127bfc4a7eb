"""The pick: the ready replica predicted to give a request its first token soonest. Pure: no I/O, the
clock is an argument.

What decides a request's time to first token at a replica is what is ahead of it there. An engine
admits requests first come, first served, into at most ``max_num_seqs`` running sequences, and
prefills them in steps of at most ``max_num_batched_tokens``. So a request sent behind the ones in
flight

- waits for a sequence slot, which a running request frees when it has generated its last token
  (its remaining tokens times the replica's decode step, after the prefill admitted with it: a step
  that prefills holds back every running sequence). A decode step costs more the more sequences it
  runs, so it is priced at the batch the replica will run with this request (``Rates.decode_step_at``);
- is then prefilled behind the prefill queued ahead of it (one engine: prefill is serial), at the
  replica's seconds per prefill token, plus one decode step per step-budget chunk.

:func:`predict_ttft` replays that over the door's own view of a replica, the :class:`Flight` of each
request it sent there in sending order. That view is exact the moment a request is sent, where a scrape
is up to an interval old: a burst is spread by the work and the sequence slots each request takes.
The engine's report (:class:`EngineLoad`) gives the sizes (``kvpilot_config_info``), the rates (the
step counters, ``kvpilot_engine_step_*``), and the requests it holds that did not come through this
door. Where the engine does not say, :class:`ScoringConfig`'s priors stand in.

The pick looks one request ahead (:func:`lookahead_costs`): a candidate costs the worse of this
request's predicted first token there and the soonest one left for a next request bringing this
prompt uncached. Prefix affinity needs no weight of its own: a replica holding a prefix of the prompt
has fewer tokens to prefill, so it is predicted sooner unless what waits there outweighs the saving.
Costs within ``tie_s`` of the least count as equal; among those the longest prefix match wins, then
turns are taken.
A replica whose KV cache is nearly full (``kv_overload``) is charged one typical generation, the wait a
preemption or a queue for blocks would add.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Mapping, Sequence

REASON_PREFIX = "prefix"  # sent to a replica holding a prefix of the prompt
REASON_LOAD = "load"  # sent to the soonest replica, which holds no prefix of the prompt
REASON_ROUND_ROBIN = "round_robin"  # the round-robin policy's turn
REASONS = (REASON_PREFIX, REASON_LOAD, REASON_ROUND_ROBIN)


@dataclasses.dataclass(frozen=True)
class EngineLoad:
    """One replica's report from one ``/metrics`` scrape.

    The gauges ``vllm:num_requests_waiting``, ``vllm:num_requests_running`` and
    ``vllm:kv_cache_usage_perc`` (0..1); when it was read (monotonic seconds) and the door's in-flight
    count to that replica then. ``max_num_seqs`` / ``max_num_batched_tokens``: from
    ``kvpilot_config_info`` (None: not exported, as by vLLM). ``prefill_s_per_token`` /
    ``decode_step_s``: the replica's measured rates (None: not known yet), the decode step as the mean
    over steps of ``decode_mean_seqs`` sequences, each sequence more or fewer adding or taking
    ``decode_step_per_seq_s`` (None: not known, the step is taken as flat)."""

    num_requests_waiting: float
    num_requests_running: float
    kv_cache_usage: float
    scraped_at: float
    in_flight_at_scrape: int = 0
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    prefill_s_per_token: float | None = None
    decode_step_s: float | None = None
    decode_mean_seqs: float | None = None
    decode_step_per_seq_s: float | None = None


@dataclasses.dataclass
class Flight:
    """A request the door sent to a replica and whose answer has not ended: the prompt tokens the
    replica did not hold when it was sent, the output tokens it may generate (``max_tokens``; None:
    not bounded by the request), the output events seen so far, whether its first output came (its
    prefill is over), and its prompt's length in characters. Mutable: the proxy updates it as the
    answer streams."""

    uncached_tokens: float
    max_tokens: int | None = None
    outputs: int = 0
    prefilled: bool = False
    prompt_chars: int = 0

    def remaining_tokens(self, typical_output: float) -> float:
        """Output tokens still to come: up to the typical answer's length (the door's running mean),
        never past ``max_tokens``, and at least one."""
        expected = typical_output if self.max_tokens is None else min(self.max_tokens, typical_output)
        return max(1.0, expected - self.outputs)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A ready replica: its URL, the door's flights to it in sending order, its last scrape (None:
    none yet), and how many leading blocks of this request's prompt it served before."""

    url: str
    flights: Sequence[Flight] = ()
    load: EngineLoad | None = None
    prefix_blocks: int = 0


@dataclasses.dataclass(frozen=True)
class ScoringConfig:
    """Priors for what an engine does not report, and the pick's thresholds.

    ``max_num_seqs`` / ``max_num_batched_tokens``: the sizes of an engine that exports no
    ``kvpilot_config_info`` (vLLM's defaults). ``prefill_s_per_token`` / ``decode_step_s``: its
    rates until measured. ``typical_output_tokens`` / ``typical_prompt_tokens``: the answer length
    and the uncached prompt assumed before the door has seen any. ``kv_overload``: KV usage from
    which a replica is charged one typical generation. ``max_metrics_age_s``: older scrapes are
    ignored. ``tie_s``: predictions this close are equal. ``max_simulated``: flights replayed per
    replica at most (the rest are costed at their mean)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    prefill_s_per_token: float = 2e-4
    decode_step_s: float = 0.03
    typical_output_tokens: float = 256.0
    typical_prompt_tokens: float = 512.0
    kv_overload: float = 0.95
    max_metrics_age_s: float = 1.0
    tie_s: float = 1e-3
    max_simulated: int = 512

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_simulated"):
            if getattr(self, name) < 1:
                raise ValueError(f"ScoringConfig.{name} must be at least 1, not {getattr(self, name)}")
        for name in (
            "prefill_s_per_token",
            "decode_step_s",
            "typical_output_tokens",
            "typical_prompt_tokens",
            "max_metrics_age_s",
            "tie_s",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"ScoringConfig.{name} must not be negative, not {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class Pick:
    """The chosen replica, why (``REASON_PREFIX`` / ``REASON_LOAD``), every candidate's cost (what the
    pick minimised, :func:`lookahead_costs`), the prompt tokens the chosen one does not hold (its
    prefill work), and every candidate's predicted seconds to this request's first token."""

    url: str
    reason: str
    costs: Mapping[str, float]
    uncached_tokens: float = 0.0
    predicted: Mapping[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Rates:
    """What :func:`predict_ttft` runs on for one replica: its sizes and its rates (the decode step
    at ``decode_mean_seqs`` sequences, and its growth per sequence)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_s_per_token: float
    decode_step_s: float
    decode_mean_seqs: float = 1.0
    decode_step_per_seq_s: float = 0.0

    def decode_step_at(self, num_seqs: float) -> float:
        """Seconds of a decode step of ``num_seqs`` sequences (never below a fifth of the mean step)."""
        step = self.decode_step_s + self.decode_step_per_seq_s * (num_seqs - self.decode_mean_seqs)
        return max(step, self.decode_step_s / 5)


def fresh_load(candidate: Candidate, now: float, config: ScoringConfig) -> EngineLoad | None:
    """The candidate's scrape when it is recent enough to use, else None."""
    load = candidate.load
    if load is None or now - load.scraped_at > config.max_metrics_age_s:
        return None
    return load


def rates_of(load: EngineLoad | None, config: ScoringConfig) -> Rates:
    """The replica's reported sizes and measured rates, the config's priors where it said nothing.
    Sizes and rates are kept from any scrape, however old: they change only with a restart."""

    def reported(value, prior):
        return prior if load is None or value is None else value

    return Rates(
        max_num_seqs=max(1, int(reported(load and load.max_num_seqs, config.max_num_seqs))),
        max_num_batched_tokens=max(
            1, int(reported(load and load.max_num_batched_tokens, config.max_num_batched_tokens))
        ),
        prefill_s_per_token=reported(load and load.prefill_s_per_token, config.prefill_s_per_token),
        decode_step_s=reported(load and load.decode_step_s, config.decode_step_s),
        decode_mean_seqs=reported(load and load.decode_mean_seqs, 1.0),
        decode_step_per_seq_s=reported(load and load.decode_step_per_seq_s, 0.0),
    )


def unseen_requests(candidate: Candidate, now: float, config: ScoringConfig) -> tuple[int, int]:
    """(running, waiting): the requests the engine held at its last fresh scrape beyond those this
    door had sent it then (another door's, or sent to the replica directly), the waiting ones first."""
    load = fresh_load(candidate, now, config)
    if load is None:
        return 0, 0
    held = load.num_requests_running + load.num_requests_waiting
    unseen = max(0, round(held - load.in_flight_at_scrape))
    waiting = min(unseen, round(load.num_requests_waiting))
    return unseen - waiting, waiting


def predict_ttft(
    candidate: Candidate,
    uncached_tokens: float,
    *,
    now: float,
    typical_output: float,
    typical_prompt: float,
    config: ScoringConfig = ScoringConfig(),
) -> float:
    """Seconds from now until a request with ``uncached_tokens`` to prefill, sent to ``candidate``
    behind its flights, gets its first token (see the module docstring). Requests the engine holds
    that the door did not send are taken as typical: a running one half-way through a
    ``typical_output`` answer, a waiting one with a ``typical_prompt`` to prefill."""
    rates = rates_of(candidate.load, config)
    budget = rates.max_num_batched_tokens
    running, waiting = unseen_requests(candidate, now, config)
    # Decode steps run as many sequences as the replica will hold: this request, those ahead of it,
    # up to its slots.
    batch = min(rates.max_num_seqs, running + waiting + len(candidate.flights) + 1)
    step = rates.decode_step_at(batch)

    def prefill_time(tokens: float) -> float:
        chunks = -(-max(tokens, 1.0) // budget)
        return tokens * rates.prefill_s_per_token + chunks * step

    ahead = (
        [Flight(0.0, outputs=int(typical_output // 2), prefilled=True)] * running
        + [Flight(typical_prompt)] * waiting
        + list(candidate.flights)
    )
    tail = ahead[config.max_simulated :]
    ahead = ahead[: config.max_simulated]
    # Requests admitted at the same moment form a wave: they decode only once the wave's prefill is
    # over (a step that prefills also holds back every running sequence), so the slots they take
    # free a whole generation after that.
    slots: list[float] = []  # when each sequence slot frees, for the closed waves
    wave: list[float] = []  # remaining tokens of the open wave's requests
    wave_start = 0.0
    prefill_done = 0.0  # when the prefill queued so far is over

    def close_wave() -> None:
        for remaining in wave:
            heapq.heappush(slots, max(wave_start, prefill_done) + remaining * step)
        wave.clear()

    def admit() -> float:
        """When the next request in line gets a sequence slot (a new wave when it differs)."""
        nonlocal wave_start
        if len(slots) + len(wave) < rates.max_num_seqs:
            start = 0.0
        else:
            close_wave()
            start = heapq.heappop(slots)
        if wave and start != wave_start:
            close_wave()
        wave_start = start
        return start

    for flight in ahead:
        start = admit()
        if not flight.prefilled:
            prefill_done = max(start, prefill_done) + prefill_time(flight.uncached_tokens)
        wave.append(flight.remaining_tokens(typical_output))
    start = admit()
    if tail:  # beyond the replayed: each takes its share of the slots' and the prefill's time
        per_flight = sum(
            f.remaining_tokens(typical_output) * step / rates.max_num_seqs
            + (0.0 if f.prefilled else prefill_time(f.uncached_tokens))
            for f in tail
        )
        start += per_flight
        prefill_done += per_flight
    ttft = max(start, prefill_done) + prefill_time(uncached_tokens)
    load = fresh_load(candidate, now, config)
    if load is not None and load.kv_cache_usage >= config.kv_overload:
        ttft += typical_output * step
    return ttft


def pick(
    candidates: Sequence[Candidate],
    *,
    now: float,
    prompt_tokens: float = 0.0,
    tokens_per_block: float = 16.0,
    typical_output: float | None = None,
    typical_prompt: float | None = None,
    turn: int = 0,
    config: ScoringConfig = ScoringConfig(),
) -> Pick | None:
    """The candidate of the least cost: the worse of its predicted first token for this request and
    the soonest one left for the next (:func:`lookahead_costs`; None for no candidate).
    ``prompt_tokens``: the request's estimated prompt length; each candidate's prefix blocks take
    ``tokens_per_block`` each off it. ``typical_output`` / ``typical_prompt``: the door's mean answer
    length and uncached prompt (None: the config's priors). Among costs within ``tie_s`` the longest
    prefix match, then the ``turn``-th, so that a caller counting its picks spreads ties."""
    if not candidates:
        return None
    typical = config.typical_output_tokens if typical_output is None else typical_output
    prompt = config.typical_prompt_tokens if typical_prompt is None else typical_prompt

    def predict(candidate: Candidate, tokens: float) -> float:
        return predict_ttft(
            candidate, tokens, now=now, typical_output=typical, typical_prompt=prompt, config=config
        )

    costs: dict[str, float] = {}
    uncached: dict[str, float] = {}
    for candidate in candidates:
        uncached[candidate.url] = max(0.0, prompt_tokens - candidate.prefix_blocks * tokens_per_block)
        costs[candidate.url] = predict(candidate, uncached[candidate.url])
    predicted = dict(costs)
    if len(candidates) > 1:
        costs = lookahead_costs(candidates, predicted, uncached, prompt_tokens, predict)
    least = min(costs.values())
    tied = [c for c in candidates if costs[c.url] <= least + config.tie_s]
    longest = max(c.prefix_blocks for c in tied)
    tied = [c for c in tied if c.prefix_blocks == longest]
    chosen = tied[turn % len(tied)]
    return Pick(
        url=chosen.url,
        reason=REASON_PREFIX if chosen.prefix_blocks > 0 else REASON_LOAD,
        costs=costs,
        uncached_tokens=uncached[chosen.url],
        predicted=predicted,
    )


def lookahead_costs(
    candidates: Sequence[Candidate],
    predicted: Mapping[str, float],
    uncached: Mapping[str, float],
    prompt_tokens: float,
    predict,
) -> dict[str, float]:
    """Per candidate, the worse of this request's predicted first token there and the soonest one
    left for a next request bringing this prompt uncached, were this one sent there. A pick for each
    request's own first token alone fills a prefix holder's sequence slots with cheap requests and
    leaves the next uncached prompts fewer places to go; this keeps the place the next one needs
    unless taking it makes this request's own wait the worse one."""
    alone = {c.url: predict(c, prompt_tokens) for c in candidates}
    costs = {}
    for candidate in candidates:
        sent = dataclasses.replace(candidate, flights=[*candidate.flights, Flight(uncached[candidate.url])])
        left = [alone[o.url] for o in candidates if o.url != candidate.url]
        costs[candidate.url] = max(predicted[candidate.url], min([predict(sent, prompt_tokens), *left]))
    return costs
