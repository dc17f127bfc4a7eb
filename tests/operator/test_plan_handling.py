"""The server's turn on each request in the plan's simulation: a burst reaches the engine one turn
apart, and the step then running waits for the server to take it in (``simulate(handling=...)``);
the turn's distribution comes from the recorded arrival gaps (``handling.handling_time_of``)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvpilot.operator.plan.handling import HandlingTime, handling_time_of
from kvpilot.operator.plan.simulate import Arrival, EngineSettings, SimulationError, StepTrace, simulate
from kvpilot.operator.remediation.metrics import Histogram

SETTINGS = EngineSettings(
    num_gpu_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128
)


@dataclasses.dataclass(frozen=True)
class FixedStep:
    """Every step takes 1 s."""

    def step_seconds(self, num_batched_tokens: int, num_seqs: int, *shape: int) -> float:
        return 1.0


def _turn(seconds: float):
    return lambda u: seconds


def test_a_burst_on_an_idle_engine_reaches_it_one_turn_apart() -> None:
    """Three requests sent at 0, a 0.2 s turn each way: they reach the engine at 0.2, 0.4 and 0.6.
    The first starts a step at 0.2 that needs 1 s of the interpreter, shared with the server taking
    in the other two (to 0.6) and starting r0's response (to 0.8): it ends at 1.8, r0's first token
    1.6 s after it arrived. r1 and r2 run in the next step, from 1.8, which also waits for their
    responses to start: to 3.2. Sent at once with no turns, all three share the first step."""
    arrivals = [Arrival(0.0, 8, 1) for _ in range(3)]
    traces: list[StepTrace] = []
    spaced = simulate(SETTINGS, arrivals, FixedStep(), handling=_turn(0.2), on_step=traces.append)
    assert [t.scheduled for t in traces] == [(("r0", 8),), (("r1", 8), ("r2", 8))]
    assert list(spaced.ttft_s) == pytest.approx([1.6, 2.8, 2.6])
    assert spaced.duration_s == pytest.approx(3.2)
    at_once = simulate(SETTINGS, arrivals, FixedStep())
    assert list(at_once.ttft_s) == [1.0, 1.0, 1.0] and at_once.duration_s == 1.0


def test_a_burst_during_a_step_holds_that_step_and_runs_together_after_it() -> None:
    """r0 reaches the engine at 0.2 (its turn) and its first step ends at 1.4 (its response's turn);
    it decodes from then on, 1 s a step. Three requests sent at 1.5, inside its second step, each take
    a 0.2 s turn: the server holds the interpreter 0.6 s of that step, which ends at 3.0 (r0's token
    1.6 s after its last), once the burst is in at 1.7, 1.9 and 2.1. The three run together in the
    next step, which their responses' turns stretch to 4.6: first tokens 2.9, 2.7 and 2.5 s after
    they arrived. Without turns they arrive at 1.5, join r0's step at 2 and wait 1.5 s."""
    arrivals = [Arrival(0.0, 8, 5)] + [Arrival(1.5, 8, 1) for _ in range(3)]
    traces: list[StepTrace] = []
    result = simulate(SETTINGS, arrivals, FixedStep(), handling=_turn(0.2), on_step=traces.append)
    assert traces[2].scheduled == (("r0", 1), ("r1", 8), ("r2", 8), ("r3", 8))
    assert sorted(result.ttft_s) == pytest.approx([1.2, 2.5, 2.7, 2.9])
    assert max(result.itl_s) == pytest.approx(1.6)
    plain = simulate(SETTINGS, arrivals, FixedStep())
    assert sorted(plain.ttft_s) == [1.0, 1.5, 1.5, 1.5] and max(plain.itl_s) == 1.0


def test_closed_loop_clients_wait_their_turnaround_then_the_servers_turn() -> None:
    """Two clients, four 2-token requests, a 0.5 s turnaround and 0.1 s turns. r0 reaches the engine
    at 0.1 and r1 at 0.2; r0's first step ends at 1.3 (r1's turn, then r0's response's). r1 runs from
    1.3 to 2.4 (its response's turn). r0 ends at 2.4: its client sends r2 at 2.9, in at 3.0 during
    r1's last step, which ends at 3.5. r2's step (with its response's turn) would end at 4.6, but r1's
    client, free at 4.0, sends r3 in at 4.1: 4.7. r3 runs from 4.7 to 5.8, and decodes to 6.8."""
    arrivals = [Arrival(0.0, 8, 2) for _ in range(4)]
    result = simulate(
        SETTINGS, arrivals, FixedStep(), max_in_flight=2, client_turnaround_s=0.5, handling=_turn(0.1)
    )
    assert list(result.ttft_s) == pytest.approx([1.2, 2.2, 1.7, 1.7])
    assert result.num_finished == 4 and result.duration_s == pytest.approx(6.8)
    assert max(s.num_running + s.num_waiting for s in result.samples) <= 2


def test_the_draws_follow_the_seed_and_a_negative_turn_is_refused() -> None:
    arrivals = [Arrival(0.01 * i, 8, 3) for i in range(40)]
    turns = HandlingTime(((0.5, 0.0, 0.1), (1.0, 0.1, 0.4)), samples=10)
    one = simulate(SETTINGS, arrivals, FixedStep(), handling=turns.draw, seed=3)
    again = simulate(SETTINGS, arrivals, FixedStep(), handling=turns.draw, seed=3)
    other = simulate(SETTINGS, arrivals, FixedStep(), handling=turns.draw, seed=4)
    assert one.ttft_s == again.ttft_s and one.ttft_s != other.ttft_s
    with pytest.raises(SimulationError, match="handling time"):
        simulate(SETTINGS, arrivals, FixedStep(), handling=_turn(-0.1))


def _gaps(*counts: tuple[float, float]) -> Histogram:
    """A gap histogram with ``counts`` (upper bound, observations in that bucket), +Inf last."""
    buckets, cumulative = [], 0.0
    for le, count in counts:
        cumulative += count
        buckets.append((le, cumulative))
    return Histogram(tuple(buckets), 0.0, cumulative)


def test_handling_time_from_the_gaps_within_a_decode_step() -> None:
    gaps = _gaps((0.0001, 2), (0.0002, 4), (0.0005, 2), (0.001, 1), (0.01, 5), (math.inf, 6))
    turn = handling_time_of(gaps, within_s=0.0006)
    assert turn is not None and turn.samples == 8  # the 0.5-1 ms bucket is past the decode step
    assert turn.pieces == ((0.25, 0.0, 0.0001), (0.75, 0.0001, 0.0002), (1.0, 0.0002, 0.0005))
    assert turn.mean_s == pytest.approx((2 * 0.00005 + 4 * 0.00015 + 2 * 0.00035) / 8)
    draws = [turn.draw((i + 0.5) / 800) for i in range(800)]
    assert draws == sorted(draws) and 0.0 <= draws[0] and draws[-1] <= 0.0005
    assert sum(d <= 0.0001 for d in draws) == 200
    assert sum(draws) / 800 == pytest.approx(turn.mean_s, rel=1e-3)
    assert turn.draw(0.0) == 0.0 and turn.draw(0.999999) == pytest.approx(0.0005, rel=1e-4)
    # Too few short gaps, none at all, no histogram or no decode step: no handling time.
    assert handling_time_of(_gaps((0.0001, 2), (math.inf, 50)), within_s=0.001) is None
    assert handling_time_of(_gaps((0.01, 5), (math.inf, 50)), within_s=0.001) is None
    assert handling_time_of(None, within_s=0.001) is None
    assert handling_time_of(gaps, within_s=0.0) is None


def test_the_fit_leaves_out_the_turns_the_simulation_adds() -> None:
    """100 requests over 1.2 s of recorded steps, a 0.3 ms turn each way: 60 ms of the steps' time was
    the server's, so every coefficient keeps 95 % and the replayed variation stays as it was. The
    share is capped at half; without a turn the model is the fit's."""
    from kvpilot.operator.plan.handling import MAX_TURN_SHARE, without_turns
    from kvpilot.operator.plan.step_time import LinearStepTime, StepWindow

    model = LinearStepTime(a=0.001, c=0.0001, e=1e-8, terms=("a", "c", "e"), variation=((0.0, 10.0, 1.2),))
    windows = [StepWindow(num_steps=600, num_batched_tokens=1800, num_sampled_tokens=1800, seconds=0.6)] * 2
    turn = HandlingTime(((1.0, 0.0003, 0.0003),), samples=50)
    kept = without_turns(model, turn, 100, windows)
    assert kept.a == pytest.approx(0.00095) and kept.c == pytest.approx(0.000095)
    assert kept.e == pytest.approx(0.95e-8) and kept.b == kept.d == 0.0
    assert kept.variation == model.variation and kept.terms == model.terms
    assert without_turns(model, turn, 100_000, windows).a == pytest.approx(0.001 * (1 - MAX_TURN_SHARE))
    assert without_turns(model, None, 100, windows) is model
    assert without_turns(model, turn, 100, []) is model
