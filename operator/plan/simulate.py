"""The engine's own scheduler and block manager on a simulated clock (torch-free).

A run feeds :class:`Arrival` s (when a request comes, its prompt and output lengths) to a real
``kvpilot.engine.scheduler.Scheduler`` over a real ``BlockManager`` and steps them as
``LLMEngine.step`` does -- ``schedule()``, the runner, ``update_from_output`` -- with the runner
replaced by a synthesised ``ModelRunnerOutput`` (one token for every scheduled request that samples)
and the step's wall time by a step-time model. Requests run with ``ignore_eos`` and ``max_tokens`` =
their output length, so each generates exactly that many tokens unless ``max_model_len`` caps it,
as the engine would.

Token ids are synthetic: each request's prompt starts with a token of its own, so no two requests
share a prefix-cache block unless an arrival names a shared prefix (``prefix_group``,
``prefix_len``), which then starts every prompt of that group with the same tokens.

The engine's per-step decisions come out unchanged, since they are the engine's code; what the
simulation adds is only the clock (``step_time``) and the token values (which decide nothing under
``ignore_eos``). ``tests/operator/test_plan_simulate.py`` checks the decisions against a real
``LLMEngine`` step for step.

Clock: a step scheduled at ``now`` ends at ``now + step_seconds(tokens, seqs, context, pairs)`` (the
step's shape as ``SchedulerOutput`` counts it), times ``step_time.factor_at(now)`` where the model has
one (the recording's slow stretches, ``step_time.with_variation``; the arrivals' clock is the
recording's), times a factor drawn for the step where the model spreads single steps
(``step_time.with_jitter``); its sampled tokens are stamped with that end time.
Arrivals up to the start of a step are queued before it; with nothing to run the clock jumps to the
next arrival. Where the server's turns are modelled (``handling``), a request reaches the engine a
turn after it is sent, behind the server's earlier turns, and takes another turn once admitted (its
response starting); a step ends later by the server's time that falls within it (one interpreter).
The ``/metrics`` scrapes (``scrapes``) are turns of the server's too, one every scrape period.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from kvpilot.engine.block_manager import BlockManager
from kvpilot.engine.outputs import ModelRunnerOutput
from kvpilot.engine.request import Request
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.scheduler_output import SchedulerConfig, SchedulerOutput
from kvpilot.operator.plan.ingest import Ingest
from kvpilot.operator.plan.sim_result import Sample, SimResult, SimulationError, mean, quantile

__all__ = [
    "Arrival",
    "EngineSettings",
    "Sample",
    "SimResult",
    "SimulationError",
    "StepTime",
    "StepTrace",
    "mean",
    "quantile",
    "simulate",
]

# Prompt token ids: a distinct first token per request keeps prompts apart in the prefix cache; the
# shared prefixes of a group use ids from another range so they never collide with those.
_OWN_TOKEN_BASE = 1_000_000
_GROUP_TOKEN_BASE = 1
_FILLER_TOKEN = 7
_SAMPLED_TOKEN = 3


class StepTime(Protocol):
    """How long one engine step takes (seconds), from what the step runs."""

    def step_seconds(
        self,
        num_batched_tokens: int,
        num_seqs: int,
        decode_context_tokens: int = 0,
        prefill_attention_pairs: int = 0,
    ) -> float: ...


# A StepTime may say it ignores the attention totals (``uses_attention_shape`` False): the simulator
# then skips counting them.


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """The knobs one engine replica runs with (the engine's names; see ``EngineArgs``)."""

    num_gpu_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = False
    preemption_mode: str = "recompute"
    num_cpu_blocks: int = 0

    def __post_init__(self) -> None:
        for name in (
            "num_gpu_blocks",
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
        ):
            if getattr(self, name) <= 0:
                raise SimulationError(f"{name} must be positive, got {getattr(self, name)}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise SimulationError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        if self.num_cpu_blocks < 0:
            raise SimulationError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")


@dataclasses.dataclass(frozen=True)
class Arrival:
    """One request: when it arrives (seconds from the start), its prompt and output lengths, and
    optionally a shared prefix (the first ``prefix_len`` prompt tokens of every arrival of
    ``prefix_group`` are the same)."""

    time: float
    prompt_len: int
    output_len: int
    prefix_group: int | None = None
    prefix_len: int = 0

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise SimulationError(f"prompt and output lengths must be >= 1, got {self}")
        if not 0 <= self.prefix_len < self.prompt_len:
            raise SimulationError(f"prefix_len must be in [0, prompt_len), got {self}")


def prompt_tokens(index: int, arrival: Arrival) -> list[int]:
    """The synthetic prompt of the ``index``-th arrival: its group's shared prefix (if any), then a
    token of its own, then filler."""
    shared = arrival.prefix_len if arrival.prefix_group is not None else 0
    tokens = [_GROUP_TOKEN_BASE + (arrival.prefix_group or 0)] * shared
    tokens.append(_OWN_TOKEN_BASE + index)
    tokens += [_FILLER_TOKEN] * (arrival.prompt_len - len(tokens))
    return tokens


@dataclasses.dataclass(frozen=True)
class StepTrace:
    """What one ``schedule()`` call decided: (req_id, tokens fed) in batch order, and the requests it
    preempted. The identity test compares these with a real engine's."""

    scheduled: tuple[tuple[str, int], ...]
    preempted: tuple[str, ...]

    @classmethod
    def of(cls, out: SchedulerOutput) -> StepTrace:
        return cls(
            tuple((item.req_id, item.num_tokens) for item in out.scheduled), tuple(out.preempted_req_ids)
        )


def make_scheduler(settings: EngineSettings) -> Scheduler:
    """A fresh engine scheduler over a fresh block manager with ``settings``."""
    bm = BlockManager(
        settings.num_gpu_blocks,
        settings.block_size,
        enable_prefix_caching=settings.enable_prefix_caching,
        num_cpu_blocks=settings.num_cpu_blocks if settings.preemption_mode == "swap" else 0,
    )
    config = SchedulerConfig(
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=settings.max_model_len,
        enable_chunked_prefill=settings.enable_chunked_prefill,
        preemption_mode=settings.preemption_mode,
    )
    return Scheduler(config, bm)


class SimulatedEngine:
    """The engine's core loop with the model replaced: ``add_request`` then ``step`` as on
    ``LLMEngine``, on the engine's own ``Scheduler`` and ``BlockManager``."""

    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        self.scheduler = make_scheduler(settings)

    def add_request(self, req_id: str, prompt_token_ids: list[int], output_len: int) -> Request:
        """Queue a request that generates ``output_len`` tokens (``ignore_eos``). Raises
        SimulationError for a prompt the engine's input processor would refuse (longer than
        ``max_model_len`` or than the whole KV pool)."""
        s = self.settings
        if len(prompt_token_ids) >= s.max_model_len:
            raise SimulationError(
                f"{req_id}: prompt of {len(prompt_token_ids)} tokens leaves no room in max_model_len "
                f"{s.max_model_len}"
            )
        if len(prompt_token_ids) + 1 > s.num_gpu_blocks * s.block_size:
            raise SimulationError(
                f"{req_id}: prompt of {len(prompt_token_ids)} tokens does not fit the KV pool of "
                f"{s.num_gpu_blocks} blocks x {s.block_size}"
            )
        req = Request(
            req_id=req_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0),
            eos_token_id=None,
        )
        self.scheduler.add_request(req)
        return req

    def step(self) -> tuple[SchedulerOutput, list[str]]:
        """One engine step: schedule, synthesise the runner's output, update the requests. Returns
        the step's ``SchedulerOutput`` and the req_ids that sampled a token. A step that scheduled
        nothing ran no forward: like ``LLMEngine.step``, it skips the update."""
        out = self.scheduler.schedule()
        if not out.scheduled:
            return out, []
        sampled = [item.req_id for item in out.scheduled if item.do_sample]
        runner_out = ModelRunnerOutput(sampled, [_SAMPLED_TOKEN] * len(sampled), [None] * len(sampled))
        self.scheduler.update_from_output(out, runner_out)
        return out, sampled

    @property
    def has_unfinished(self) -> bool:
        return bool(self.scheduler.requests)


def simulate(
    settings: EngineSettings,
    arrivals: Iterable[Arrival],
    step_time: StepTime,
    *,
    max_sim_s: float | None = None,
    on_step: Callable[[StepTrace], None] | None = None,
    max_in_flight: int | None = None,
    client_turnaround_s: float = 0.0,
    handling: Callable[[float], float] | None = None,
    scrapes: tuple[float, Callable[[float], float]] | None = None,
    scrape_times: Sequence[float] = (),
    stamped: bool = False,
    seed: int = 0,
) -> SimResult:
    """Run ``arrivals`` (sorted by time here) through one simulated engine replica.

    ``max_sim_s``: stop the clock there (requests still unfinished are reported as such by
    ``truncated``; None runs until every request finishes). ``on_step`` sees the decisions of every
    ``schedule()`` call that scheduled or preempted something. ``max_in_flight``: the clients' own
    concurrency -- an arrival that finds that many requests in the engine is held back (client-side)
    until one finishes, and its latencies count from when it is sent (None: open loop, every
    arrival is sent at its time). ``client_turnaround_s`` (with ``max_in_flight``): how long a client
    takes from a request's last token to its next request reaching the engine (reading the answer,
    the round trip, the server's parsing and tokenizing): a held-back arrival is sent no earlier than
    that after the request whose place it takes finished, so it lands inside the step then running and
    waits for it, as a real client's does. ``handling``: the server's turn on a request, at a quantile
    (``handling.HandlingTime.draw``): one before the request reaches the engine (parsing, tokenizing)
    and one once the engine has admitted it (starting its response). The server takes one turn at a
    time and shares the interpreter with the engine's steps (``ingest.Ingest``), so a burst of requests
    reaches the engine spread out, the step then running waits for the server to take all of them in,
    and the step that admits them waits for their responses to start (None: no turns; every request
    reaches the engine when sent). ``scrapes``: (period, a render's time at a quantile): the server's
    turns on the ``/metrics`` scrapes, one every period (``handling.ScrapeTurns``), which hold up the
    step they fall in and the requests behind them like a request's turn (None: none), each at its
    time in ``scrape_times`` where given (the recording's, with its trace's requests: the very scrapes
    they met), else from a phase drawn with the handling times, every period after. ``stamped``: the
    arrivals' times are when they reached the engine, the server's turn on each already behind it (a
    trace's stamps), so that turn ends there rather than starting there. ``seed``: the
    draws of a step-time model that spreads single steps (``jittered``; a run with the same seed draws
    the same factors). Raises SimulationError for an arrival the engine would refuse or a step time
    that is not positive.
    """
    ordered = sorted(arrivals, key=lambda a: a.time)
    if not client_turnaround_s >= 0.0:
        raise SimulationError(f"client_turnaround_s must be >= 0, got {client_turnaround_s!r}")
    # The handling times come from a stream of their own, apart from the step spread's.
    ingest = Ingest(
        [a.time for a in ordered],
        max_in_flight,
        handling,
        random.Random(f"handling-{seed}"),
        scrapes,
        scrape_times=scrape_times,
        stamped=stamped,
    )
    # The attention totals of each step, only for a model that prices them (one pass per step).
    shaped = getattr(step_time, "uses_attention_shape", True)
    factor_at = getattr(step_time, "factor_at", None)
    # Single steps spread around the model's time (step_time.with_jitter), drawn from this run's own
    # random stream so that a candidate's result does not depend on what ran before it.
    jittered = step_time.jittered if getattr(step_time, "jitter", ()) else None
    rng = random.Random(seed) if jittered is not None else None
    engine = SimulatedEngine(settings)
    sched = engine.scheduler
    bm = sched.block_manager
    arrived_at: dict[str, float] = {}
    last_token_at: dict[str, float] = {}
    ttft: list[float] = []
    itl: list[float] = []
    samples: list[Sample] = []
    num_output_tokens = num_finished = num_steps = 0
    start = ordered[0].time if ordered else 0.0
    now = start
    truncated = False
    while ingest.pending or engine.has_unfinished:
        if max_sim_s is not None and now - start >= max_sim_s:
            truncated = True
            break
        if not engine.has_unfinished:
            now = max(now, ingest.first_stamp())  # idle: jump to the next request's arrival
        ingest.take_until(now)
        for stamp, index in ingest.reached(now):
            arrival = ordered[index]
            req_id = f"r{index}"
            engine.add_request(req_id, prompt_tokens(index, arrival), arrival.output_len)
            arrived_at[req_id] = stamp
            ingest.respond(now)
        out, sampled = engine.step()
        if on_step is not None and (out.scheduled or out.preempted_req_ids):
            on_step(StepTrace.of(out))
        if not out.scheduled:
            # Nothing ran. When the step preempted everything it scheduled, the next one runs at once
            # (the engine spends no forward on it); otherwise nothing queued can ever run, which the
            # admission checks in ``add_request`` rule out.
            if out.preempted_req_ids:
                continue
            raise SimulationError(
                f"the scheduler cannot run any of {len(sched.requests)} queued request(s) with {settings}"
            )
        num_steps += 1
        if shaped:
            context, pairs = out.attention_shape()
            duration = step_time.step_seconds(out.num_batched_tokens, len(out.scheduled), context, pairs)
        else:
            duration = step_time.step_seconds(out.num_batched_tokens, len(out.scheduled))
        if factor_at is not None:
            duration *= factor_at(now)
        if rng is not None:
            duration = jittered(duration, rng.random())
        if not duration > 0:
            raise SimulationError(f"the step-time model gave {duration!r} s for a step; it must be positive")
        now = ingest.step_end(now, duration)
        for req_id in sampled:
            previous = last_token_at.get(req_id)
            if previous is None:
                ttft.append(now - arrived_at[req_id])
            else:
                itl.append(now - previous)
            last_token_at[req_id] = now
            if req_id not in sched.requests:  # finished by this step
                num_finished += 1
                del last_token_at[req_id], arrived_at[req_id]
                ingest.finished(now + client_turnaround_s)
        num_output_tokens += len(sampled)
        samples.append(
            Sample(
                now - start,
                bm.usage,
                len(sched.waiting) + len(sched.swapped),
                len(sched.running),
                sched.num_preemptions_total,
                num_output_tokens,
            )
        )
    return SimResult(
        duration_s=now - start,
        num_steps=num_steps,
        num_preemptions=sched.num_preemptions_total,
        num_arrivals=len(ordered),
        num_finished=num_finished,
        num_output_tokens=num_output_tokens,
        samples=tuple(samples),
        ttft_s=tuple(ttft),
        itl_s=tuple(itl),
        truncated=truncated,
        start_s=start,
        prefix_queries=bm.prefix_queries,
        prefix_hits=bm.prefix_hits,
    )
