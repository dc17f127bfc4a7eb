"""The step-time model: recovered from synthetic windows whose true coefficients are known."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from kvpilot.engine.metrics_names import STEP_TIME_RATIO_BUCKETS
from kvpilot.operator.plan.step_time import (
    MIN_JITTER_STEPS,
    LinearStepTime,
    StepTimeError,
    StepWindow,
    fit_step_time,
    with_jitter,
    with_variation,
)
from kvpilot.operator.remediation.metrics import Histogram

TRUE = LinearStepTime(a=0.004, b=2e-5, c=3e-4)


def _window(tokens_per_step: float, seqs_per_step: float, num_steps: int = 100, noise: float = 0.0, rng=None):
    step = TRUE.step_seconds(tokens_per_step, seqs_per_step)
    if noise:
        step *= 1 + rng.uniform(-noise, noise)
    return StepWindow(num_steps, tokens_per_step * num_steps, seqs_per_step * num_steps, step * num_steps)


def test_exact_windows_give_the_true_coefficients() -> None:
    windows = [_window(t, s) for t, s in [(16, 16), (512, 4), (2048, 2), (64, 60), (300, 30)]]
    model = fit_step_time(windows)
    assert model.terms == ("a", "b", "c")
    assert model.a == pytest.approx(TRUE.a, rel=1e-6)
    assert model.b == pytest.approx(TRUE.b, rel=1e-6)
    assert model.c == pytest.approx(TRUE.c, rel=1e-6)
    assert model.rmse_s == pytest.approx(0.0, abs=1e-9)
    assert model.num_windows == 5


def test_noisy_windows_come_close() -> None:
    rng = random.Random(3)
    windows = [
        _window(
            rng.uniform(8, 4096), rng.uniform(1, 128), num_steps=rng.randint(50, 500), noise=0.05, rng=rng
        )
        for _ in range(200)
    ]
    model = fit_step_time(windows)
    assert model.a == pytest.approx(TRUE.a, rel=0.15)
    assert model.b == pytest.approx(TRUE.b, rel=0.1)
    assert model.c == pytest.approx(TRUE.c, rel=0.15)
    # It predicts unseen points within the noise.
    assert model.step_seconds(1000, 50) == pytest.approx(TRUE.step_seconds(1000, 50), rel=0.05)


def test_windows_weigh_by_their_steps() -> None:
    """An outlier window of one step barely moves a fit dominated by thousands of steps; the same
    outlier over as many steps as the others drags it far."""
    windows = [_window(t, s, num_steps=5000) for t, s in [(16, 16), (512, 4), (2048, 2), (64, 60)]]
    truth = TRUE.step_seconds(512, 4)
    light = fit_step_time([*windows, StepWindow(1, 100, 10, 1.0)])
    heavy = fit_step_time([*windows, StepWindow(5000, 100 * 5000, 10 * 5000, 1.0 * 5000)])
    assert light.step_seconds(512, 4) == pytest.approx(truth, rel=0.02)
    assert abs(heavy.step_seconds(512, 4) - truth) > truth


def test_windows_that_cannot_separate_the_terms_drop_the_finer_ones() -> None:
    # Every window has the same shape: only the intercept can be estimated (the mean step time).
    same = [_window(256, 8, num_steps=n) for n in (10, 20, 30)]
    model = fit_step_time(same)
    assert model.terms == ("a",)
    assert model.a == pytest.approx(TRUE.step_seconds(256, 8))
    assert model.b == model.c == 0.0
    # Tokens vary but tokens and sequences move together: the per-sequence term goes.
    collinear = [_window(16 * s, s) for s in (1, 2, 4, 8)]
    model = fit_step_time(collinear)
    assert model.terms == ("a", "b")
    for s in (1, 3, 8):
        assert model.step_seconds(16 * s, s) == pytest.approx(TRUE.step_seconds(16 * s, s), rel=1e-6)


def test_coefficients_stay_non_negative() -> None:
    """Step time that falls with batch size (a per-sequence term that would come out negative)."""
    windows = [
        StepWindow(100, t * 100, s * 100, (0.01 + 1e-5 * t - 1e-4 * s) * 100)
        for t, s in [(100, 1), (100, 20), (900, 5), (400, 40)]
    ]
    model = fit_step_time(windows)
    assert "c" not in model.terms and model.c == 0.0
    assert model.a >= 0 and model.b >= 0


def test_no_usable_window_is_an_error() -> None:
    with pytest.raises(StepTimeError, match="no window"):
        fit_step_time([StepWindow(0, 0, 0, 1.0), StepWindow(10, 100, 10, 0.0)])
    with pytest.raises(StepTimeError, match="not all 0"):
        LinearStepTime(a=0.0)
    with pytest.raises(StepTimeError, match=">= 0"):
        LinearStepTime(a=0.01, b=-1.0)


def test_step_seconds_and_describe() -> None:
    assert TRUE.step_seconds(1000, 10) == pytest.approx(0.004 + 0.02 + 0.003)
    assert LinearStepTime(a=0.0, b=1e-5).step_seconds(0, 0) == 1e-5  # never zero
    assert "4.000 ms" in TRUE.describe()


# The engine's own step counters give each window its attention totals (shape_known).
SHAPED = LinearStepTime(a=3e-4, b=1.5e-5, c=6e-5, d=2e-7, e=5e-8, terms=("a", "b", "c", "d", "e"))


def _shaped(seqs: int, prompt: int, context: int, steps: int = 50) -> StepWindow:
    """``steps`` steps of ``seqs`` decodes at ``context`` positions each, plus one fresh prompt of
    ``prompt`` tokens per step when ``prompt`` > 0."""
    tokens = seqs + prompt
    ctx = seqs * context
    pairs = prompt * (prompt + 1) // 2
    step = SHAPED.step_seconds(tokens, seqs + (prompt > 0), ctx, pairs)
    return StepWindow(
        steps, tokens * steps, (seqs + (prompt > 0)) * steps, step * steps, ctx * steps, pairs * steps, True
    )


def test_shaped_windows_give_the_attention_terms() -> None:
    windows = [
        _shaped(s, p, c)
        for s, p, c in [
            (1, 0, 16),
            (4, 0, 16),
            (8, 0, 40),
            (4, 0, 1800),
            (1, 300, 300),
            (2, 1500, 200),
            (0, 1000, 0),
        ]
    ]
    model = fit_step_time(windows)
    assert model.terms == ("a", "b", "c", "d", "e")
    for name in ("a", "b", "c", "d", "e"):
        assert getattr(model, name) == pytest.approx(getattr(SHAPED, name), rel=1e-6), name
    # A 2,000-token prompt: the pairs term is most of it, which a per-token term alone cannot give.
    assert model.step_seconds(2000, 1, 0, 2000 * 2001 // 2) > 4 * (model.a + 2000 * model.b + model.c)
    assert "ns/prefill pair" in model.describe()


def test_windows_without_the_shape_fit_the_three_older_terms() -> None:
    """vLLM's recordings carry no attention totals: d and e are not fitted, whatever else the windows say."""
    windows = [
        dataclasses.replace(_shaped(s, p, c), shape_known=False)
        for s, p, c in [(1, 0, 16), (4, 0, 16), (8, 0, 40), (1, 300, 300), (2, 1500, 200)]
    ]
    model = fit_step_time(windows)
    assert set(model.terms) <= {"a", "b", "c"}
    assert model.d == model.e == 0.0


def test_collinear_tokens_and_seqs_keep_the_attention_terms() -> None:
    """Decode-only windows move tokens and sequences together; the fit gives up the per-sequence term
    (its effect goes to the per-token one), not the attention terms the windows do separate."""
    windows = [_shaped(s, 0, c) for s, c in [(1, 16), (4, 16), (8, 40), (4, 1800), (2, 900)]]
    model = fit_step_time(windows)
    assert "c" not in model.terms and "d" in model.terms
    assert model.d == pytest.approx(SHAPED.d, rel=1e-6)
    assert model.b == pytest.approx(SHAPED.b + SHAPED.c, rel=1e-6)


def _decodes(num_steps: float, seconds: float) -> StepWindow:
    """``num_steps`` one-sequence decodes of one token each that took ``seconds`` in all."""
    return StepWindow(num_steps, num_steps, num_steps, seconds, shape_known=True)


def test_variation_is_each_stretchs_time_over_the_fits() -> None:
    model = LinearStepTime(a=0.001)  # 1 ms a step whatever its shape
    intervals = [
        (0.0, 1.0, (_decodes(100, 0.1),)),  # as fitted
        (1.0, 2.0, (_decodes(50, 0.075), _decodes(50, 0.075))),  # 1.5 ms a step: x1.5
        (2.0, 3.0, (_decodes(10, 0.05),)),  # too few steps to tell a slow stretch from one slow step
        (3.0, 4.0, (_decodes(100, 0.08),)),  # x0.8
    ]
    varied = with_variation(model, intervals, min_steps=20)
    assert [(start, end) for start, end, _ in varied.variation] == [(0.0, 1.0), (1.0, 2.0), (3.0, 4.0)]
    assert [f for _, _, f in varied.variation] == pytest.approx([1.0, 1.5, 0.8])
    assert [varied.factor_at(t) for t in (0.5, 1.0, 1.99, 2.5, 3.2)] == pytest.approx(
        [1.0, 1.5, 1.5, 1.0, 0.8]
    )
    assert varied.factor_at(-1.0) == 1.0  # before the recording
    # Past the recording's end (4 s) the stretches repeat: 5.5 s is 1.5 s, 7.5 s is 3.5 s.
    assert varied.factor_at(5.5) == pytest.approx(1.5) and varied.factor_at(7.5) == pytest.approx(0.8)
    # The fit's own time is unchanged; the simulator multiplies by the factor.
    assert varied.step_seconds(1, 1) == model.step_seconds(1, 1)
    assert "x0.80-x1.50 over 3 segment(s)" in varied.describe()


def test_variation_pools_the_pods_that_overlap() -> None:
    model = LinearStepTime(a=0.001)
    # Two pods scraped half a second apart: where both are open their steps pool (x1 with 300 steps
    # and x2 with 100: 500 ms over 400 ms), elsewhere each pod's own factor.
    intervals = [(0.0, 1.0, (_decodes(300, 0.3),)), (0.5, 1.5, (_decodes(100, 0.2),))]
    varied = with_variation(model, intervals, min_steps=20)
    assert [(start, end) for start, end, _ in varied.variation] == [(0.0, 0.5), (0.5, 1.0), (1.0, 1.5)]
    assert [f for _, _, f in varied.variation] == pytest.approx([1.0, 0.5 / 0.4, 2.0])


def test_no_variation_without_shaped_windows_or_steps() -> None:
    model = LinearStepTime(a=0.001)
    # Another engine's windows (no shape): what the fit misses there is mostly the steps' shape.
    unshaped = [(0.0, 1.0, (StepWindow(100, 100, 100, 0.3),))]
    assert with_variation(model, unshaped).variation == ()
    assert with_variation(model, [(0.0, 1.0, ())]) is model
    assert model.factor_at(3.0) == 1.0
    with pytest.raises(StepTimeError):
        LinearStepTime(a=0.001, variation=((1.0, 0.5, 1.0),))


def _ratios(counts: dict[float, float], total_sum: float | None = None) -> Histogram:
    """A ratio histogram with the engine's buckets holding ``counts`` observations per bound."""
    buckets, running = [], 0.0
    for le in (*STEP_TIME_RATIO_BUCKETS, math.inf):
        running += counts.get(le, 0.0)
        buckets.append((le, running))
    return Histogram(tuple(buckets), total_sum if total_sum is not None else running, running)


def test_jitter_draws_the_recorded_spread_with_the_fits_mean() -> None:
    """800 steps at 0.95-1.0 of their mean, 150 at 1.0-1.05, 40 at 1.4-1.5 and 10 at 4-5: drawn
    factors fall in those ranges as often, scaled so that they average 1 (the fit keeps its mean)."""
    model = LinearStepTime(0.001, variation=((0.0, 10.0, 1.5),))
    jittered = with_jitter(model, _ratios({1.0: 800, 1.05: 150, 1.5: 40, 5.0: 10}))
    assert jittered.variation == () and jittered.jitter_steps == 1000
    mean = (800 * 0.975 + 150 * 1.025 + 40 * 1.45 + 10 * 4.5) / 1000
    draws = [jittered.jitter_factor((k + 0.5) / 10_000) for k in range(10_000)]
    assert sum(draws) / len(draws) == pytest.approx(1.0, abs=1e-3)
    assert sum(0.95 / mean <= f <= 1.0 / mean for f in draws) == 8000
    assert sum(1.4 / mean <= f <= 1.5 / mean for f in draws) == 400
    assert max(draws) <= 5.0 / mean and sum(f >= 4.0 / mean for f in draws) == 100
    assert jittered.jitter_factor(0.3) == jittered.jitter_factor(0.3)  # a function of the draw alone
    assert "x0." in jittered.describe() and "1000 recorded decode steps" in jittered.describe()
    # The +Inf bucket sits at the highest finite bound.
    tail = with_jitter(model, _ratios({1.0: 900, math.inf: 100}))
    assert tail.jitter_factor(0.99) == pytest.approx(50.0 / (0.9 * 0.975 + 0.1 * 50.0))


def test_the_spread_adds_at_most_a_decode_steps_share_to_a_long_step() -> None:
    """Measured on decode steps of 1 ms, a factor of 1.6 adds 0.6 ms: to a 0.5 ms step its own share (0.3
    ms), to a 40 ms prefill step 0.6 ms, not 24 (a turn at the interpreter does not grow with the step).
    A fast draw takes off as little. Without a scale the factor multiplies the whole step."""
    model = LinearStepTime(0.001)
    spread = with_jitter(model, _ratios({1.0: 500, 3.0: 500}), scale_s=0.001)
    assert spread.jitter_scale_s == 0.001 and "at most the 1.000 ms" in spread.describe()
    slow, fast = 0.99, 0.01
    f_slow, f_fast = spread.jitter_factor(slow), spread.jitter_factor(fast)
    assert f_slow > 1.5 and f_fast < 0.55
    assert spread.jittered(0.040, slow) == pytest.approx(0.040 + (f_slow - 1) * 0.001)
    assert spread.jittered(0.0005, slow) == pytest.approx(0.0005 * f_slow)
    assert spread.jittered(0.040, fast) == pytest.approx(0.040 - (1 - f_fast) * 0.001)
    whole = with_jitter(model, _ratios({1.0: 500, 3.0: 500}))
    assert whole.jitter_scale_s == 0.0 and whole.jittered(0.040, slow) == pytest.approx(0.040 * f_slow)
    with pytest.raises(StepTimeError):
        LinearStepTime(0.001, jitter_scale_s=-1.0)


def test_too_few_ratios_leave_the_model_as_it_is() -> None:
    model = LinearStepTime(0.001, variation=((0.0, 10.0, 1.5),))
    few = _ratios({1.0: MIN_JITTER_STEPS - 1})
    assert with_jitter(model, few) is model
    assert model.jitter_factor(0.5) == 1.0
