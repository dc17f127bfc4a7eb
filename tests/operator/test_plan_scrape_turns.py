"""The server's turns on the ``/metrics`` scrapes in the plan's simulation: one every scrape period, on
the interpreter the engine's steps and the requests' turns share (``ingest.Ingest``,
``simulate(scrapes=...)``); their period and render times come from the engine's
``kvpilot_engine_metrics_render_seconds`` over the recording (``handling.scrape_turns_of``)."""

from __future__ import annotations

import math
import random

import pytest

from kvpilot.operator.plan.handling import HandlingTime, ScrapeTurns, scrape_turns_of, without_turns
from kvpilot.operator.plan.ingest import Ingest
from kvpilot.operator.plan.simulate import Arrival, SimulationError, simulate
from kvpilot.operator.plan.step_time import LinearStepTime, StepWindow
from tests.operator.test_plan_handling import SETTINGS, FixedStep, _gaps, _turn


def test_a_step_ends_later_by_every_scrape_that_comes_before_it_ends() -> None:
    """Scrapes every 1 s from 0.5, 0.25 s each. A 1 s step from 0 meets the one at 0.5: it ends at
    1.25. The next, from 1.25, meets the one at 1.5 and ends at 2.5, just as the one at 2.5 comes, so
    the step from 2.5 waits for that one and meets the one at 3.5 too: it ends at 4.0."""
    ingest = Ingest([], None, None, random.Random(0), scrapes=(1.0, _turn(0.25)), scrape_phase=0.5)
    assert ingest.step_end(0.0, 1.0) == pytest.approx(1.25)
    assert ingest.step_end(1.25, 1.0) == pytest.approx(2.5)
    assert ingest.step_end(2.5, 1.0) == pytest.approx(4.0)
    # No scrapes: the step takes its own time.
    plain = Ingest([], None, None, random.Random(0))
    assert plain.step_end(0.0, 1.0) == 1.0 and plain.next_scrape == math.inf


def test_scrapes_come_at_their_given_times_then_every_period() -> None:
    """Scrapes given at 0.3 and 0.5 (0.25 s each), then every 1 s: at 1.5, 2.5, ... A 1 s step from 0
    meets both given ones and ends at 1.5, as the next comes: the step from 1.5 meets that one and the
    one at 2.5, and ends at 3.0; the next scrape is at 3.5."""
    ingest = Ingest([], None, None, random.Random(0), (1.0, _turn(0.25)), scrape_times=[0.5, 0.3])
    assert ingest.step_end(0.0, 1.0) == pytest.approx(1.5)
    assert ingest.step_end(1.5, 1.0) == pytest.approx(3.0)
    assert ingest.next_scrape == pytest.approx(3.5)
    # Without scrape turns the given times mean nothing.
    assert Ingest([], None, None, random.Random(0), None, scrape_times=[0.3]).step_end(0.0, 1.0) == 1.0


def test_a_request_meets_the_scrape_given_at_its_time_whatever_the_seed() -> None:
    """Requests every 2 s, a one-step prefill of 1 s each; scrapes given at 4.5 and 10.2 (0.3 s each),
    then every 100 s. The requests sent at 4 and 10 meet them and take 1.3 s to their first token,
    with any seed; every other one takes 1 s."""
    arrivals = [Arrival(2.0 * i, 8, 1) for i in range(40)]
    for seed in (1, 2, 3):
        run = simulate(
            SETTINGS, arrivals, FixedStep(), scrapes=(100.0, _turn(0.3)), scrape_times=[4.5, 10.2], seed=seed
        )
        assert [round(t, 6) for t in run.ttft_s[:8]] == [1.0, 1.0, 1.3, 1.0, 1.0, 1.3, 1.0, 1.0]
        assert max(run.ttft_s[8:]) == pytest.approx(1.0) and min(run.ttft_s) == pytest.approx(1.0)


def test_a_traced_request_reaches_the_engine_at_its_stamp_its_turn_behind_it() -> None:
    """A trace stamps each request where it reached the engine, after the server's turn on it. With
    0.1 s turns, requests stamped at 1.0 and 1.05 reach the engine at 1.0 (the turn ran from 0.9) and
    1.1 (its turn waited for the first's); taken as sent at those times they would reach it at 1.1 and
    1.2. A scrape given at 0.97 comes after both turns began and renders after them, until 1.35."""
    scrapes = (100.0, _turn(0.25))
    stamped = Ingest([1.0, 1.05], None, _turn(0.1), random.Random(0), scrapes, None, [0.97], True)
    stamped.take_until(1.05)
    assert [stamp for stamp, _ in stamped.reached(2.0)] == pytest.approx([1.0, 1.1])
    assert stamped.step_end(1.1, 0.1) == pytest.approx(1.35 + 0.1)
    sent = Ingest([1.0, 1.05], None, _turn(0.1), random.Random(0))
    sent.take_until(1.05)
    assert [stamp for stamp, _ in sent.reached(2.0)] == pytest.approx([1.1, 1.2])


def test_a_request_sent_during_a_scrape_is_taken_in_after_it() -> None:
    """Requests sent at 0, 0.2 and 0.6, a scrape at 0.5 rendering until 0.75. With a 0.1 s turn each,
    the first two are in at 0.1 and 0.3; the third, sent during the scrape, takes its turn after it
    and reaches the engine at 0.85. Without turns of their own, it is in once the scrape is done."""
    turned = Ingest([0.0, 0.2, 0.6], None, _turn(0.1), random.Random(0), (1.0, _turn(0.25)), 0.5)
    turned.take_until(1.0)
    assert [stamp for stamp, _ in turned.reached(1.0)] == pytest.approx([0.1, 0.3, 0.85])
    unturned = Ingest([0.0, 0.2, 0.6], None, None, random.Random(0), (1.0, _turn(0.25)), 0.5)
    unturned.take_until(1.0)
    assert [stamp for stamp, _ in unturned.reached(1.0)] == pytest.approx([0.0, 0.2, 0.75])


def test_scrapes_raise_the_first_tokens_they_meet_and_follow_the_seed() -> None:
    """A request every 2 s for 400 s, each a one-step prefill; a scrape every 3 s. Without scrapes
    every first token takes 1 s. With them, the third of the steps that meet a scrape take the
    render's 0.3 s more, and the rest their 1 s. The phase follows the seed."""
    arrivals = [Arrival(2.0 * i, 8, 1) for i in range(200)]
    plain = simulate(SETTINGS, arrivals, FixedStep())
    assert set(plain.ttft_s) == {1.0}
    scraped = simulate(SETTINGS, arrivals, FixedStep(), scrapes=(3.0, _turn(0.3)), seed=1)
    met = [t for t in scraped.ttft_s if t > 1.0 + 1e-9]
    assert met and max(met) == pytest.approx(1.3) and min(met) > 1.0
    assert len(met) / len(scraped.ttft_s) == pytest.approx(1 / 3, abs=0.02)
    assert min(scraped.ttft_s) == pytest.approx(1.0)
    again = simulate(SETTINGS, arrivals, FixedStep(), scrapes=(3.0, _turn(0.3)), seed=1)
    other = simulate(SETTINGS, arrivals, FixedStep(), scrapes=(3.0, _turn(0.3)), seed=2)
    assert again.ttft_s == scraped.ttft_s and other.ttft_s != scraped.ttft_s


def test_a_bad_scrape_period_or_render_is_refused() -> None:
    arrivals = [Arrival(0.0, 8, 2)]
    with pytest.raises(SimulationError, match="scrape period"):
        simulate(SETTINGS, arrivals, FixedStep(), scrapes=(0.0, _turn(0.1)))
    with pytest.raises(SimulationError, match="render time"):
        simulate(SETTINGS, arrivals, FixedStep(), scrapes=(0.5, _turn(-0.1)))


def test_scrape_turns_from_the_render_times_over_the_pods_time() -> None:
    """60 renders over 120 pod-seconds: a scrape every 2 s, 4-5 ms three times in four, 5-6 ms once."""
    turns = scrape_turns_of(_gaps((0.004, 0), (0.005, 45), (0.006, 15), (math.inf, 0)), 120.0)
    assert turns is not None
    assert turns.period_s == pytest.approx(2.0)
    assert turns.render.pieces == ((0.75, 0.004, 0.005), (1.0, 0.005, 0.006))
    assert turns.render.mean_s == pytest.approx(0.75 * 0.0045 + 0.25 * 0.0055)
    assert turns.share == pytest.approx(turns.render.mean_s / 2.0)
    assert "every 2.00 s" in turns.describe() and "60 scrapes" in turns.describe()
    # Too few renders, no histogram or no time: none.
    assert scrape_turns_of(_gaps((0.005, 2), (math.inf, 2)), 120.0) is None
    assert scrape_turns_of(None, 120.0) is None
    assert scrape_turns_of(_gaps((0.005, 60), (math.inf, 60)), 0.0) is None


def test_the_fit_leaves_out_the_scrapes_share_of_the_time() -> None:
    """A 10 ms render every second holds the interpreter 1 % of the pod's time, and a step as often as
    the pod is busy: the coefficients keep 99 %, on top of what the requests' turns take."""
    model = LinearStepTime(a=0.001, c=0.0001, terms=("a", "c"))
    windows = [StepWindow(num_steps=600, num_batched_tokens=1800, num_sampled_tokens=1800, seconds=0.6)] * 2
    scrapes = ScrapeTurns(1.0, HandlingTime(((1.0, 0.01, 0.01),), samples=100))
    kept = without_turns(model, None, 100, windows, scrapes)
    assert kept.a == pytest.approx(0.00099) and kept.c == pytest.approx(0.000099)
    turn = HandlingTime(((1.0, 0.0003, 0.0003),), samples=50)
    both = without_turns(model, turn, 100, windows, scrapes)
    assert both.a == pytest.approx(0.001 * (1 - 0.05 - 0.01))
