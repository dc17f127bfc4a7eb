"""The pick: which ready replica takes a request, from what each one's engine last reported and what
the door itself has sent since. Pure: no I/O, the clock is an argument.

Each candidate gets a cost in units of "one request running there":

    load    = max(in_flight, running + waiting + sent_since_scrape)
    cost    = load + (waiting_weight - 1) * waiting + kv_weight * kv_cache_usage
              + prefill_weight * pending_prefill_blocks
              - prefix_weight * matched_blocks / prompt_blocks      (not when KV usage >= kv_overload)

``pending_prefill_blocks``: the prompt blocks the door sent the replica that it did not hold (no
prefix match) and whose answer has not begun (its first output) -- prefill work queued there, which a
request count does not see: a burst of long uncached prompts is spread by the work each brings, and
a prefix holder is not handed uncached prompts behind the ones it is already prefilling.

``sent_since_scrape`` (the door's in-flight count now minus at the scrape) keeps the engine's numbers
fresh between scrapes. A candidate whose metrics are older than ``max_metrics_age_s`` (or missing) is
costed on the door's own in-flight count alone. The prefix bonus sends a prompt to the replica that
served its longest prefix unless that one is loaded by more than ``prefix_weight`` requests beyond the
least loaded (or its KV cache is nearly full): then load decides. Equal costs take turns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

REASON_PREFIX = "prefix"  # sent to a replica holding a prefix of the prompt
REASON_LOAD = "load"  # sent to the cheapest replica by load alone
REASON_ROUND_ROBIN = "round_robin"  # the round-robin policy's turn
REASONS = (REASON_PREFIX, REASON_LOAD, REASON_ROUND_ROBIN)


@dataclasses.dataclass(frozen=True)
class EngineLoad:
    """One replica's gauges from one ``/metrics`` scrape: ``vllm:num_requests_waiting``,
    ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc`` (0..1), when it was read (monotonic
    seconds) and the door's in-flight count to that replica then."""

    num_requests_waiting: float
    num_requests_running: float
    kv_cache_usage: float
    scraped_at: float
    in_flight_at_scrape: int = 0


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A ready replica: its URL, the door's requests in flight to it now, its last scrape (None: none
    yet), how many leading blocks of this request's prompt it served before, and the uncached prompt
    blocks of requests sent to it whose answer has not begun."""

    url: str
    in_flight: int = 0
    load: EngineLoad | None = None
    prefix_blocks: int = 0
    pending_prefill_blocks: int = 0


@dataclasses.dataclass(frozen=True)
class ScoringConfig:
    """Weights, in requests running: ``waiting_weight`` per queued request (a queue is worse than a
    busy batch), ``kv_weight`` for a full KV cache, ``prefix_weight`` for a whole-prompt prefix match
    (the most extra load a prefix holder is given work at), ``prefill_weight`` per prompt block of
    prefill ahead (a block is 64 characters, ~16 tokens: 8 blocks, ~128 tokens of prefill, weigh as
    one more request). ``kv_overload``: KV usage from which a replica gets no prefix bonus.
    ``max_metrics_age_s``: older scrapes are ignored."""

    waiting_weight: float = 2.0
    kv_weight: float = 4.0
    prefix_weight: float = 4.0
    prefill_weight: float = 0.125
    kv_overload: float = 0.95
    max_metrics_age_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("waiting_weight", "kv_weight", "prefix_weight", "prefill_weight", "max_metrics_age_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"ScoringConfig.{name} must not be negative, not {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class Pick:
    """The chosen replica, why (``REASON_PREFIX`` / ``REASON_LOAD``), every candidate's cost, and the
    prompt blocks the chosen one does not hold (its prefill work for this request)."""

    url: str
    reason: str
    costs: Mapping[str, float]
    uncached_blocks: int = 0


def fresh_load(candidate: Candidate, now: float, config: ScoringConfig) -> EngineLoad | None:
    """The candidate's scrape when it is recent enough to use, else None."""
    load = candidate.load
    if load is None or now - load.scraped_at > config.max_metrics_age_s:
        return None
    return load


def load_cost(candidate: Candidate, now: float, config: ScoringConfig) -> float:
    """The candidate's cost before any prefix bonus (see the module docstring)."""
    load = fresh_load(candidate, now, config)
    if load is None:
        return float(candidate.in_flight)
    sent_since = candidate.in_flight - load.in_flight_at_scrape
    queued = load.num_requests_running + load.num_requests_waiting + sent_since
    return (
        max(float(candidate.in_flight), queued)
        + (config.waiting_weight - 1.0) * load.num_requests_waiting
        + config.kv_weight * load.kv_cache_usage
    )


def uncached_blocks(candidate: Candidate, prompt_blocks: int) -> int:
    """The prompt blocks the candidate would have to prefill (those past its prefix match)."""
    return max(0, prompt_blocks - candidate.prefix_blocks)


def prefill_cost(candidate: Candidate, config: ScoringConfig) -> float:
    """The prefill work queued at the candidate ahead of this request, in request units."""
    return config.prefill_weight * candidate.pending_prefill_blocks


def prefix_bonus(candidate: Candidate, prompt_blocks: int, now: float, config: ScoringConfig) -> float:
    """What holding part of the prompt's prefix takes off the candidate's cost (0 without a match, for
    a prompt shorter than a block, or with its KV cache nearly full)."""
    if prompt_blocks <= 0 or candidate.prefix_blocks <= 0:
        return 0.0
    load = fresh_load(candidate, now, config)
    if load is not None and load.kv_cache_usage >= config.kv_overload:
        return 0.0
    return config.prefix_weight * min(candidate.prefix_blocks, prompt_blocks) / prompt_blocks


def pick(
    candidates: Sequence[Candidate],
    *,
    now: float,
    prompt_blocks: int = 0,
    turn: int = 0,
    config: ScoringConfig = ScoringConfig(),
) -> Pick | None:
    """The cheapest candidate (None for none); among equal costs the ``turn``-th, so that a caller
    counting its picks spreads ties. ``prompt_blocks``: the request's hashed blocks (0: no prefix)."""
    if not candidates:
        return None
    costs: dict[str, float] = {}
    bonuses: dict[str, float] = {}
    for candidate in candidates:
        bonuses[candidate.url] = prefix_bonus(candidate, prompt_blocks, now, config)
        costs[candidate.url] = (
            load_cost(candidate, now, config) + prefill_cost(candidate, config) - bonuses[candidate.url]
        )
    least = min(costs.values())
    tied = [c for c in candidates if costs[c.url] == least]
    chosen = tied[turn % len(tied)]
    return Pick(
        url=chosen.url,
        reason=REASON_PREFIX if bonuses[chosen.url] > 0 else REASON_LOAD,
        costs=costs,
        uncached_blocks=uncached_blocks(chosen, prompt_blocks),
    )
