"""The long-run forecast (amp_exp/forecast/) on synthetic signals, whose true trend is known.

The statistical rules are checked by simulation at the rates they state, against the binomial
bound for the repetitions run that a rule holding its rate falls outside of only as often as a
normal variable passes three standard deviations (``at_least``, ``at_most``): a crossing
interval at level 1 - alpha covers the true crossing step at least that often, also where the
growth slows (the form the real cases showed) and under a cosine learning-rate schedule (growth
per unit of rate, and growth per step); a run whose signals are all flat raises a false alarm at
most alpha of the time; a changepoint is found and the later regime extrapolated. Each
simulation runs in a second or two.
"""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest
import scipy.stats

from amp_exp.forecast.__main__ import FORECAST_JSON, FORECAST_MD, main
from amp_exp.forecast.fit import CHANGEPOINT_ALPHA, MIN_POINTS, fit_trend
from amp_exp.forecast.forecast import ALPHA, forecast_run, holm
from amp_exp.forecast.markdown import crossing_sentence, forecast_markdown
from amp_exp.training.optim import CosineWithWarmup

FORMAT_MAX = 448.0
LOG_EVERY = 10


# A rule that holds its rate fails a simulation test this often (a normal's three-sigma tail).
TAIL = float(scipy.stats.norm.sf(3))


def at_least(rate: float, repetitions: int) -> float:
    """The fewest successes in ``repetitions`` that a rule holding ``rate`` falls below with
    probability under TAIL (the exact binomial bound, for few repetitions as for many)."""
    return float(scipy.stats.binom.ppf(TAIL, repetitions, rate))


def at_most(rate: float, repetitions: int) -> float:
    """The most events in ``repetitions`` that a rule holding ``rate`` exceeds with probability
    at most TAIL."""
    return float(scipy.stats.binom.isf(TAIL, repetitions, rate))


def covers(interval: list, step: float) -> bool:
    """Whether ``step`` lies in a crossing interval (its end None: past the planned end)."""
    low, high = interval
    return low <= step <= (math.inf if high is None else high)


def rows_of(series: dict[str, np.ndarray], steps: np.ndarray, scale=None, lr=None) -> list[dict]:
    """metrics.jsonl rows: a train row and a signals row per log step."""
    rows = []
    for index, step in enumerate(steps):
        rows.append(
            {
                "kind": "train",
                "step": int(step),
                "lr": 0.01 if lr is None else lr[index],
                "grad_norm": 1.0,
                "scale": None if scale is None else float(scale[index]),
                "skipped_steps": 0,
            }
        )
        signals = {"kind": "signals", "step": int(step), "format": "fp8_e4m3fn"}
        signals |= {"format_max": FORMAT_MAX, "attn_logit_limit": 1e9}
        signals |= {key: float(values[index]) for key, values in series.items()}
        rows.append(signals)
    return rows


def growing(steps: np.ndarray, rng, start: float, rate: float, noise: float) -> np.ndarray:
    """Log-linear growth ``start * exp(rate * step)`` with log-normal noise."""
    return start * np.exp(rate * steps + noise * rng.standard_normal(len(steps)))


def first_past(steps: np.ndarray, values: np.ndarray, limit: float, direction: int = 1) -> float:
    """The truth a forecast is judged by: the first log step whose value is past the limit (the
    run's own continuation, noise and all), or infinity where none is."""
    past = np.flatnonzero(direction * (values - limit) > 0)
    return float(steps[past[0]]) if past.size else math.inf


def test_the_crossing_interval_covers_the_true_crossing_at_its_stated_rate() -> None:
    """An activation growing log-linearly (its trend at e4m3's 448 at step 1000), observed over
    a quarter of that: the interval (1 - ALPHA) holds the step at which the run's own
    continuation first logs a value past 448 at least that often (an interval ignoring the
    slope's error would miss it about half the time), and the crossing is named whenever it is
    forecast at all."""
    rng = np.random.default_rng(0)
    steps = np.arange(LOG_EVERY, 2001, LOG_EVERY, dtype=float)
    start, rate = 1.0, math.log(FORMAT_MAX) / 1000
    repetitions, covered, named = 150, 0, 0
    for _ in range(repetitions):
        values = growing(steps, rng, start, rate, 0.1)
        observed = steps < 260
        rows = rows_of({"act_absmax/blocks.0": values[observed]}, steps[observed])
        first = forecast_run(rows, 2000)["first_crossing"]
        if first is None:
            continue
        named += 1
        assert (first["signal"], first["module"]) == ("act_absmax", "blocks.0")
        covered += covers(first["interval"], first_past(steps, values, FORMAT_MAX))
    assert named >= 0.95 * repetitions
    assert covered >= at_least(1 - ALPHA, repetitions)


def test_when_growth_slows_the_interval_still_covers_the_crossing_at_its_stated_rate() -> None:
    """Growth whose rate falls steadily (to 70% of its first rate by the crossing at step 1000,
    as in the real cases of docs/forecast.md), observed over a quarter of the way: the line
    alone puts the crossing early with an interval that misses it most of the time; the
    interval must still cover it at its stated rate, as the quadratic form's spread makes it
    (dropping that form from the hull fails this test)."""
    rng = np.random.default_rng(5)
    steps = np.arange(LOG_EVERY, 2001, LOG_EVERY, dtype=float)
    observed = steps < 260
    # log y = r0 s - c s^2 / 2, the rate r0 - c s at 1000 being 0.7 r0: 448 at step 1000.
    r0 = math.log(FORMAT_MAX) / 850
    curve = np.exp(r0 * steps - 0.3 * r0 / 1000 * steps**2 / 2)
    repetitions, covered, named = 150, 0, 0
    for _ in range(repetitions):
        values = curve * np.exp(0.05 * rng.standard_normal(len(steps)))
        rows = rows_of({"act_absmax/blocks.0": values[observed]}, steps[observed])
        first = forecast_run(rows, 2000)["first_crossing"]
        named += first is not None
        truth = first_past(steps, values, FORMAT_MAX)
        covered += first is not None and covers(first["interval"], truth)
    assert named >= 0.95 * repetitions
    assert covered >= at_least(1 - ALPHA, repetitions)


def cosine_rates(
    steps: np.ndarray, total: int, base: float = 0.01, floor: float = 0.1
) -> np.ndarray:
    """The learning rate at each step under the engine's cosine schedule (warm-up 20 steps,
    down to ``floor`` of the base)."""
    schedule = CosineWithWarmup(total, 20, floor)
    return base * np.array([schedule(int(step)) for step in steps])


def test_under_a_cosine_schedule_the_learning_rate_axis_forecasts_the_stretched_run() -> None:
    """A signal whose log grows with the cumulative learning rate, in a 250-step run with a
    warm-up and a cosine decay, forecast to 1,000 steps of the same schedule stretched. The
    truth is summed step by step over the planned run's own rates. The per-step fit sees the
    growth slow as the rate decays and carries the slow late trend on (the crossing far late,
    its interval missing it); the cumulative-rate fit must cover it at the stated rate."""
    rng = np.random.default_rng(6)
    observed, planned = 250, 1000
    steps = np.arange(5, observed + 1, 5, dtype=float)
    rates = cosine_rates(np.arange(observed + 1), observed)
    cumulative = np.concatenate([[0.0], np.cumsum(rates)])[steps.astype(int)]
    planned_rates = cosine_rates(np.arange(planned) * observed / planned, observed)
    planned_cumulative = np.cumsum(planned_rates)
    # The log signal gains k per unit of cumulative rate, and crosses log(448) at step 700.
    k = math.log(FORMAT_MAX) / planned_cumulative[699]
    truth = int(np.argmax(k * planned_cumulative >= math.log(FORMAT_MAX))) + 1
    repetitions, covered, per_step_covered = 100, 0, 0
    for _ in range(repetitions):
        values = np.exp(k * cumulative + 0.05 * rng.standard_normal(len(steps)))
        signal = {"act_absmax/blocks.0": values}
        first = forecast_run(rows_of(signal, steps, lr=rates[steps.astype(int)]), planned)
        first = first["first_crossing"]
        covered += first is not None and covers(first["interval"], truth)
        per_step = forecast_run(rows_of(signal, steps, lr=[None] * len(steps)), planned)
        per_step = per_step["first_crossing"]
        per_step_covered += per_step is not None and covers(per_step["interval"], truth)
    assert covered >= at_least(1 - ALPHA, repetitions)
    assert per_step_covered / repetitions <= 0.5


def test_under_a_cosine_schedule_a_growth_per_step_is_covered_by_the_step_axis() -> None:
    """A signal whose log grows by the same amount every step whatever the rate (the planted
    growth of docs/forecast.md), in a 250-step run with a warm-up and a cosine decay, forecast to
    1,000 steps of the schedule stretched: the true crossing, at step 700, must be covered at the
    stated rate and a line with the step in it named as the deciding one (the step's, or the
    mixed line, which holds the step's: it wins the AIC's pick by chance about 16% of the time,
    chi-squared(1) past its penalty of 2, and decides in half of those, where its slope over the
    rate has the step's sign: 9 of these 100). The cumulative-rate axis alone sees
    the growth speed up as the rate decays and puts the crossing far early (7 of 100
    runs covered it when the step axis was not among the forms)."""
    rng = np.random.default_rng(12)
    observed, planned = 250, 1000
    steps = np.arange(5, observed + 1, 5, dtype=float)
    rates = cosine_rates(steps, observed)
    k = math.log(FORMAT_MAX) / 700
    repetitions, covered, per_step = 100, 0, 0
    for _ in range(repetitions):
        values = np.exp(k * steps + 0.05 * rng.standard_normal(len(steps)))
        rows = rows_of({"act_absmax/blocks.0": values}, steps, lr=rates)
        first = forecast_run(rows, planned)["first_crossing"]
        covered += first is not None and covers(first["interval"], 700)
        per_step += first is not None and "step" in first["decided_by"]["axis"]
    assert covered >= at_least(1 - ALPHA, repetitions)
    assert per_step >= at_least(1 - ALPHA, repetitions)


def test_under_a_cosine_schedule_a_growth_part_per_rate_part_per_step_is_covered() -> None:
    """A signal whose log grows half per unit of rate and half per step (planted cosine seed 2 of
    docs/forecast.md: a block's own growth with the rate and a planted one per step), in a
    250-step run with a warm-up and a cosine decay to 0, forecast to 1,000 steps of the schedule
    stretched. The truth is summed step by step over the planned run's own rates and steps. It
    lies between the one-axis forms; the mixed line over both axes must cover it at the stated
    rate (without the mixed line 39 of 100 runs were covered, 61 forecast nothing)."""
    rng = np.random.default_rng(13)
    observed, planned = 250, 1000
    steps = np.arange(LOG_EVERY, observed + 1, LOG_EVERY, dtype=float)
    rates = cosine_rates(np.arange(observed + 1), observed, floor=0.0)
    cumulative = np.concatenate([[0.0], np.cumsum(rates)])[steps.astype(int)]
    planned_cumulative = np.cumsum(
        cosine_rates(np.arange(planned) * observed / planned, observed, floor=0.0)
    )
    # Each part brings half of log(448) by step 750.
    k_rate = math.log(FORMAT_MAX) / 2 / planned_cumulative[749]
    k_step = math.log(FORMAT_MAX) / 2 / 750
    trend = k_rate * planned_cumulative + k_step * np.arange(1, planned + 1)
    truth = int(np.argmax(trend >= math.log(FORMAT_MAX))) + 1
    repetitions, covered = 100, 0
    for _ in range(repetitions):
        noise = 0.05 * rng.standard_normal(len(steps))
        values = np.exp(k_rate * cumulative + k_step * steps + noise)
        rows = rows_of({"act_absmax/blocks.0": values}, steps, lr=rates[steps.astype(int)])
        first = forecast_run(rows, planned)["first_crossing"]
        covered += first is not None and covers(first["interval"], truth)
    assert covered >= at_least(1 - ALPHA, repetitions)


def test_attention_logits_are_fitted_in_their_own_units_never_by_factors() -> None:
    """Planted seed 2's quarter (docs/forecast.md): attention logits growing by factors from
    0.05 while the weights leave their start, then levelling off far below fp16's 16.6. Fitted by
    factors, the trend crossed by step 127 of 200; a logit's trend is judged in its own units,
    where the same points do not reach the limit."""
    steps = np.arange(5, 55, 5, dtype=float)
    logits = 0.05 * np.exp(0.045 * (steps - 5)) * np.exp(0.05 * np.cos(steps))
    rows = rows_of({"attn_logit_max/blocks.0": logits}, steps)
    for row in rows:
        row["attn_logit_limit"] = 16.6
    forecast = forecast_run(rows, 200)
    (signal,) = [s for s in forecast["signals"] if s["signal"] == "attn_logit_max"]
    assert signal["space"] == "linear"
    assert forecast["first_crossing"] is None


def test_growth_that_has_slowed_is_not_carried_forward_at_its_average_rate() -> None:
    """The healthy quarter of docs/forecast.md (lr 3e-2, seed 2): attention logits rising fast
    and levelling off near 45, 10 log points, forecast to 4x against a limit of 103. The line
    through them crosses it (78 of 100 runs alarmed when the line decided whatever its quadratic
    showed); the slowing test hands the decision to the quadratic, which levels off: at most
    ALPHA of runs alarm."""
    rng = np.random.default_rng(10)
    steps = np.arange(5, 55, 5, dtype=float)
    curve = 45 * (1 - np.exp(-steps / 20))
    repetitions, alarms = 100, 0
    for _ in range(repetitions):
        rows = rows_of({"attn_logit_max/blocks.0": curve + rng.standard_normal(len(steps))}, steps)
        for row in rows:
            row["attn_logit_limit"] = 103.3
        alarms += forecast_run(rows, 200)["first_crossing"] is not None
    assert alarms <= at_most(ALPHA, repetitions)


def test_where_the_line_holds_the_slowing_test_replaces_it_at_its_stated_rate() -> None:
    """Log-linear growth with noise: the quadratic takes the decision from the line at most
    CHANGEPOINT_ALPHA / 2 of the time, its one-sided level (8 of 2,000 when first written; at
    the slope test's level, ALPHA / 2, 23 of these 1,000: the test fails)."""
    rng = np.random.default_rng(11)
    u = np.arange(LOG_EVERY, 260, LOG_EVERY, dtype=float)
    repetitions, replaced = 1000, 0
    for _ in range(repetitions):
        values = growing(u, rng, 1.0, math.log(FORMAT_MAX) / 1000, 0.1)
        trend = fit_trend([u], values, log=True, try_log=True)
        replaced += trend.decider(+1) is not trend.line
    rate = CHANGEPOINT_ALPHA / 2
    assert replaced <= at_most(rate, repetitions)


def powered(steps: np.ndarray, rng, power: float, end: float, planned: int, noise: float):
    """A block's largest activation growing as ``power`` of the cumulative rate (a product of
    weight matrices each moved by about the rate a step, as under Adam), at ``end`` by step
    ``planned``, with log-normal noise; the rate is rows_of's constant 0.01."""
    u, at_end = 0.01 * steps, 0.01 * planned
    return end * (u / at_end) ** power * np.exp(noise * rng.standard_normal(len(steps)))


def test_growth_by_a_power_of_the_cumulative_rate_is_forecast_at_its_stated_rate() -> None:
    """An activation growing as the square of the cumulative rate (two weight matrices, each
    moved linearly), observed over a quarter of the steps it takes to reach e4m3's 448: the
    crossing is named, and its interval covers it, at the stated rate. Without the power law
    among the deciding forms, 9 of these 150 were named: the growth speeds up in the signal's own
    units and slows in log space, so a straight line in its own units was likeliest in 145 and
    fell short of the limit by the planned end; with it, 149 named and 144 covered."""
    rng = np.random.default_rng(14)
    steps = np.arange(LOG_EVERY, 260, LOG_EVERY, dtype=float)
    repetitions, covered = 150, 0
    for _ in range(repetitions):
        values = powered(steps, rng, 2.0, FORMAT_MAX, 1000, 0.1)
        first = forecast_run(rows_of({"act_absmax/blocks.0": values}, steps), 2000)
        first = first["first_crossing"]
        covered += first is not None and covers(first["interval"], 1000)
    assert covered >= at_least(1 - ALPHA, repetitions)


def test_growth_by_a_power_of_the_rate_far_from_its_limit_raises_no_false_alarm() -> None:
    """A whole run's activation growing as the square root of the cumulative rate, with the
    noise of a real one (log sd 0.25: the fp16 MLP of docs/forecast.md, whose layers grew as
    powers 0.3 to 0.9 with log sd 0.1 to 0.4), 80 log points, forecast to 10x its length, where
    its trend stands at a hundredth of the limit: at most ALPHA of runs alarm, the rate a flat
    signal may. The log line, a factor per unit of rate, carried the later points' rate forward
    by factors: without the power law among the deciding forms, 32 of these 150 alarmed (with
    it, none)."""
    rng = np.random.default_rng(15)
    steps = np.arange(25, 2001, 25, dtype=float)
    repetitions, alarms = 150, 0
    for _ in range(repetitions):
        values = powered(steps, rng, 0.5, FORMAT_MAX / 100, 20_000, 0.25)
        rows = rows_of({"act_absmax/blocks.0": values}, steps)
        alarms += forecast_run(rows, 20_000)["first_crossing"] is not None
    assert alarms <= at_most(ALPHA, repetitions)


def test_with_a_constant_rate_the_learning_rate_axis_is_the_step_axis() -> None:
    """A constant rate makes the cumulative rate a multiple of the step, so the forecast must
    not change with it (a wrong stretch of the planned run's axis would move the crossing)."""
    rng = np.random.default_rng(7)
    steps = np.arange(LOG_EVERY, 260, LOG_EVERY, dtype=float)
    values = growing(steps, rng, 1.0, math.log(FORMAT_MAX) / 1000, 0.1)
    by_rate = forecast_run(rows_of({"act_absmax/blocks.0": values}, steps), 2000)
    by_step = forecast_run(rows_of({"act_absmax/blocks.0": values}, steps, lr=[None] * 25), 2000)
    assert by_rate["axis"] != by_step["axis"]
    # Equal to a step of the grid the crossings are looked for on (rounding may move one).
    first, second = by_rate["first_crossing"], by_step["first_crossing"]
    assert first["step"] == pytest.approx(second["step"], abs=2)
    assert first["interval"] == pytest.approx(second["interval"], abs=2)


def test_flat_signals_raise_a_false_alarm_at_most_at_the_stated_rate() -> None:
    """Eight flat, noisy limited signals (four blocks' activations and attention logits):
    family-wise, a run alarms at most ALPHA of the time (without the Bonferroni split it would
    be near 8 x ALPHA / 2)."""
    rng = np.random.default_rng(1)
    steps = np.arange(LOG_EVERY, 260, LOG_EVERY, dtype=float)
    repetitions, alarms = 150, 0
    for _ in range(repetitions):
        series = {}
        for block in range(4):
            series[f"act_absmax/blocks.{block}"] = growing(steps, rng, 100.0, 0.0, 0.2)
            series[f"attn_logit_max/blocks.{block}"] = 5 + rng.standard_normal(len(steps))
        rows = rows_of(series, steps)
        for row in rows:
            row["attn_logit_limit"] = 12.0
        alarms += forecast_run(rows, 2600)["first_crossing"] is not None
    assert alarms <= at_most(ALPHA, repetitions)


def test_flat_signals_under_a_decay_to_zero_raise_a_false_alarm_at_most_at_the_stated_rate():
    """Under a decay to zero, the cumulative-rate axis must not make flat noisy signals alarm
    more than ALPHA of the time (the fear that once kept the axis out: the squeezed last log
    steps taken as a trend)."""
    rng = np.random.default_rng(8)
    steps = np.arange(LOG_EVERY, 260, LOG_EVERY, dtype=float)
    rates = cosine_rates(steps, 250, floor=0.0)
    repetitions, alarms = 100, 0
    for _ in range(repetitions):
        series = {
            f"act_absmax/blocks.{block}": growing(steps, rng, 100.0, 0.0, 0.2) for block in range(4)
        }
        alarms += forecast_run(rows_of(series, steps, lr=rates), 2500)["first_crossing"] is not None
    assert alarms <= at_most(ALPHA, repetitions)


def test_a_rise_at_the_end_of_a_decay_to_zero_is_not_a_regime_of_its_own() -> None:
    """A signal flat until its last 60 steps, where the rate is almost 0, then rising by 35%:
    in the cumulative rate those points sit at almost one value, a vertical trend, so a
    changepoint among them alone would forecast a crossing at once (65 of 100 runs alarm when
    a changepoint may leave them alone; 3 of 100 with the rule that it leaves a quarter of the
    axis's span each side). Over the step, the second axis here, the same rise is a ramp: 40 of
    100 alarm when the break leaves a quarter of the rate's span only, not of every axis's, and
    57 when the step's line may decide where its quadratic shows it does not hold. The mixed line
    fits it as a fall per unit of rate that a rise per step makes up: 87 of 100 alarm when it may
    decide with its two parts pulling against each other."""
    rng = np.random.default_rng(9)
    steps = np.arange(LOG_EVERY, 260, LOG_EVERY, dtype=float)
    rates = cosine_rates(steps, 250, floor=0.0)
    rise = np.where(steps > 190, 0.3 * (steps - 190) / 60, 0.0)
    repetitions, alarms = 100, 0
    for _ in range(repetitions):
        values = 100 * np.exp(rise + 0.05 * rng.standard_normal(len(steps)))
        rows = rows_of({"act_absmax/blocks.0": values}, steps, lr=rates)
        alarms += forecast_run(rows, 2500)["first_crossing"] is not None
    assert alarms / repetitions <= 0.2


def test_after_a_changepoint_the_later_regime_is_extrapolated() -> None:
    """Flat for 150 steps, then growing to cross at step 1000: the fit starts after the break
    (a fit over the whole run would put the crossing far later), and the interval covers it at
    the stated rate."""
    rng = np.random.default_rng(2)
    steps = np.arange(LOG_EVERY, 310, LOG_EVERY, dtype=float)
    rate = math.log(FORMAT_MAX / 2.0) / (1000 - 150)
    truth = 2.0 * np.exp(rate * np.clip(steps - 150, 0, None))
    repetitions, covered, from_break = 100, 0, 0
    for _ in range(repetitions):
        values = truth * np.exp(0.05 * rng.standard_normal(len(steps)))
        forecast = forecast_run(rows_of({"act_absmax/blocks.0": values}, steps), 3000)
        fitted = next(s for s in forecast["signals"] if s["signal"] == "act_absmax")
        from_break += fitted["fit_from_step"] >= 120
        first = forecast["first_crossing"]
        covered += first is not None and covers(first["interval"], 1000)
    assert from_break >= 0.9 * repetitions
    assert covered >= at_least(1 - ALPHA, repetitions)


def test_a_falling_loss_scale_is_forecast_to_reach_the_floor() -> None:
    """fp16's scale halving every 40 steps from 2^16 reaches min_scale 1 near step 640."""
    steps = np.arange(LOG_EVERY, 170, LOG_EVERY, dtype=float)
    scale = 2.0 ** (16 - np.floor(steps / 40))
    forecast = forecast_run(rows_of({}, steps, scale=scale), 2000, min_scale=1.0)
    first = forecast["first_crossing"]
    assert first["signal"] == "scale" and first["limit"] == "precision.min_scale"
    assert covers(first["interval"], 640)


def test_a_loss_scale_falling_by_factors_is_never_decided_by_a_straight_fall_to_zero() -> None:
    """A scale whose log2 falls one level per 1,000 steps (noise 0.3 of a level) reaches 2^14 at
    step 4,000; forecast from 500 steps to 2,000 it must raise a false alarm in at most 5% of
    runs. A straight line in the scale's own units, which falls to zero, decided 17 of 100
    where the AIC preferred it; in log space only (FACTOR_UNITS), 1."""
    steps = np.arange(25, 501, 25, dtype=float)
    repetitions, alarms = 100, 0
    for seed in range(repetitions):
        level = 18 - steps / 1000 + np.random.default_rng(seed).normal(0, 0.3, len(steps))
        rows = rows_of({}, steps, scale=2.0**level)
        alarms += forecast_run(rows, 2000, min_scale=2.0**14)["first_crossing"] is not None
    assert alarms <= at_most(ALPHA, repetitions)


def scale_rows(steps: np.ndarray, level: np.ndarray, reads: np.ndarray) -> list[dict]:
    """Train rows of an fp16 run: the scale as read at each log step (``reads``, log2) and its
    geometric mean over the interval (``level``, log2)."""
    rows = rows_of({}, steps, scale=2.0**reads)
    for row in rows:
        if row["kind"] == "train":
            row["scale_mean"] = float(2.0 ** level[list(steps).index(row["step"])])
    return rows


def test_the_loss_scale_is_forecast_from_its_mean_over_each_interval_not_from_one_read() -> None:
    """fp16's scale flips a level or two from one log step to the next: here the reads swing
    between 2^19 and 2^17 with no trend, while the level they sample (``scale_mean``, the
    geometric mean over each interval) falls from 2^18 by one halving per 500 steps, to the
    floor 2^16 at step 1000. A forecast of the reads would be silent."""
    steps = np.arange(LOG_EVERY, 501, LOG_EVERY, dtype=float)
    level = 18 - steps / 500 + np.random.default_rng(1).normal(0, 0.05, len(steps))
    reads = 18 + (-1) ** np.arange(len(steps))
    first = forecast_run(scale_rows(steps, level, reads), 2000, min_scale=2.0**16)["first_crossing"]
    assert first["signal"] == "scale" and first["step"] < 1000


def fp16_scale(rng, steps: np.ndarray, level: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A GradScaler's scale about its level (log2): the interval means a tenth of a level off
    it, the reads a whole level or two (the halvings and the doublings between), as powers of
    two."""
    means = level + rng.normal(0, 0.1, len(steps))
    return means, np.round(level + rng.normal(0, 0.75, len(steps)))


def test_the_loss_scale_crossing_is_the_first_read_below_the_floor() -> None:
    """The run stops at the first log step whose scale, as read, is below precision.min_scale.
    The reads scatter a level or so about the trend of the interval means, so that read comes
    well before the trend itself reaches the floor: here the trend falls one level per 1,000
    steps from 2^18 and reaches 2^14 at step 4,000, and the first read below comes near 2,500.
    From 2,000 steps to 8,000 the interval holds the first read below the floor at its stated
    rate, and the forecast step is a central one of them; a forecast of where the trend reaches
    the floor (4,000) misses both."""
    steps = np.arange(25, 8001, 25, dtype=float)
    observed = steps <= 2000
    repetitions, covered, estimates, truths = 100, 0, [], []
    for seed in range(repetitions):
        means, reads = fp16_scale(np.random.default_rng(seed), steps, 18 - steps / 1000)
        rows = scale_rows(steps[observed], means[observed], reads[observed])
        first = forecast_run(rows, 8000, min_scale=2.0**14)["first_crossing"]
        truth = first_past(steps, reads, 14, -1)
        truths.append(truth)
        estimates.append(math.inf if first is None else first["step"])
        covered += first is not None and covers(first["interval"], truth)
    assert covered >= at_least(1 - ALPHA, repetitions)
    low, high = np.percentile(truths, [25, 75])
    assert low <= np.median(estimates) <= high


def test_a_loss_scale_falling_by_a_power_of_the_rate_is_carried_on_not_turned_back() -> None:
    """fp16 loss scales fall fast at first and slower later (docs/forecast.md, the fp16 drift):
    the scale follows the inverse of the gradients' largest element, which the bounded steps of
    Adam grow at most as a power of the cumulative rate. A quadratic in log space through such a
    fall bends back up and never reaches the floor; the power law carries the fall on. Here the
    level falls by half a level per doubling of the step, from 2^18 at step 100, and the reads
    reach 2^14 near step 4,000: from 2,000 steps to 20,000 the crossing is named, and its
    interval holds it, at the stated rate."""
    steps = np.arange(25, 20001, 25, dtype=float)
    observed = steps <= 2000
    repetitions, covered = 60, 0
    for seed in range(repetitions):
        level = 18 - 0.5 * np.log2(steps / 100)
        means, reads = fp16_scale(np.random.default_rng(seed), steps, level)
        rows = scale_rows(steps[observed], means[observed], reads[observed])
        first = forecast_run(rows, 20000, min_scale=2.0**14)["first_crossing"]
        covered += first is not None and covers(first["interval"], first_past(steps, reads, 14, -1))
    assert covered >= at_least(1 - ALPHA, repetitions)


def test_a_fall_by_a_power_of_the_rate_seen_over_a_quarter_is_not_carried_on_by_factors() -> None:
    """The fp16 drift's level (2^17.7 at step 250, falling 0.45 of a level per doubling of the
    step), its interval means as noisy as the drift's early ones (0.4 of a level), seen for 500
    steps: its reads reach 2^14 near step 16,000, so a forecast to 2,000 must alarm in at most
    5% of runs. Over 20 points the log line (a fall by factors) fits about as well and carries
    the early fast fall on: with it deciding wherever the AIC picked it, 31 of 150 alarmed; with
    the power law deciding wherever it is plausible, 7."""
    steps = np.arange(25, 501, 25, dtype=float)
    level = 17.7 - 0.45 * np.log2(steps / 250)
    repetitions, alarms = 150, 0
    for seed in range(repetitions):
        rng = np.random.default_rng(seed)
        means = level + rng.normal(0, 0.4, len(steps))
        reads = np.round(level + rng.normal(0, 0.75, len(steps)))
        rows = scale_rows(steps, means, reads)
        alarms += forecast_run(rows, 2000, min_scale=2.0**14)["first_crossing"] is not None
    assert alarms <= at_most(ALPHA, repetitions)


@pytest.mark.parametrize(
    ("level", "observed", "planned"),
    [
        # The reads reach the floor near the planned end: the true chance is 23%.
        (lambda steps: 18 - steps / 1000, 2000, 3000),
        # A flat scale 4.5 levels above the floor: passing it is a far tail, a chance of 1e-7.
        (lambda steps: 18 + 0 * steps, 1000, 3000),
    ],
)
def test_the_chance_of_a_crossing_by_the_end_lies_in_its_interval_at_its_stated_rate(
    level, observed, planned
) -> None:
    """The chance that the planned run reads a scale below the floor by its end, with its
    interval, against the true chance (the reads' noise is known here: 0.75 of a level, normal,
    rounded to the lattice). The chance of a tail event turns on the reads' spread more than on
    the trend: with the spread taken as known (its estimate), the interval covered 22 and 6 of
    60; with t noise in the interval's bounds (counting the spread's uncertainty twice), the far
    tail's covered 26 of 60."""
    steps = np.arange(25, planned + 1, 25, dtype=float)
    seen, truth = steps <= observed, level(steps)
    chance = 1 - np.prod(scipy.stats.norm.cdf((truth[~seen] - 13.5) / 0.75))
    repetitions, covered = 0, 0
    for seed in range(60):
        rng = np.random.default_rng(seed)
        means = truth + rng.normal(0, 0.1, len(steps))
        reads = np.round(truth + rng.normal(0, 0.75, len(steps)))
        if (reads[seen] < 14).any():
            continue  # crossed already: its chance is 1, observed
        rows = scale_rows(steps[seen], means[seen], reads[seen])
        forecast = forecast_run(rows, planned, min_scale=2.0**14)
        (scale,) = [signal for signal in forecast["signals"] if signal["signal"] == "scale"]
        repetitions += 1
        covered += covers(scale["chance"]["interval"], chance)
        if forecast["first_crossing"] is None:
            # A silence still says the chance: it is no promise near the floor.
            assert "The likeliest to is scale (precision.min_scale): a chance of" in (
                crossing_sentence(forecast)
            )
    assert repetitions >= 50
    assert covered >= at_least(1 - ALPHA, repetitions)


def test_holm_rejects_step_down_where_bonferroni_would_stop() -> None:
    """Holm's step-down at 5% over six tests: five p-values of 0.001 pass alpha / 6 to alpha / 2,
    and 0.02 then passes alpha / 1 (Bonferroni's alpha / 6 would leave it: the fp16 drift's
    scale beside five growing activations, which missed so); a p-value that fails its step
    stops every larger one, whatever its order in the list."""
    assert holm([0.001] * 5 + [0.02], 0.05) == [True] * 6
    assert holm([0.03, 0.001, 0.02, 0.04], 0.05) == [False, True, False, False]
    assert holm([0.5, 0.004, 0.01], 0.05) == [False, True, True]


def test_a_limit_already_past_in_the_run_is_its_observed_crossing_not_a_forecast() -> None:
    """An activation that logged a value past e4m3's 448 at step 30 and fell back: the crossing
    is that step, observed, whatever the trend (flat here) would say."""
    steps = np.arange(LOG_EVERY, 200, LOG_EVERY, dtype=float)
    values = np.full(len(steps), 100.0)
    values[2] = 500.0
    forecast = forecast_run(rows_of({"act_absmax/blocks.0": values}, steps), 2000)
    first = forecast["first_crossing"]
    assert first["observed"] and first["step"] == 30 and first["interval"] == [30, 30]
    assert "already crossed" in crossing_sentence(forecast)
    assert "step 30 (observed)" in forecast_markdown("run", forecast)


def test_a_block_scaled_run_s_block_spread_is_forecast_against_its_scale_range() -> None:
    """NVFP4's blocks' maxima spreading by factors toward the 229,376 its E4M3 scales span: the
    crossing is named against that range (a run without ``scale_range`` has no such limit)."""
    steps = np.arange(LOG_EVERY, 301, LOG_EVERY, dtype=float)
    spread = growing(steps, np.random.default_rng(0), 100, 1 / 60, 0.1)
    rows = rows_of({"act_block_spread/blocks.0": spread}, steps)
    for row in rows:
        if row["kind"] == "signals":
            row |= {"block_format": "nvfp4", "scale_range": 448 * 2**9}
    first = forecast_run(rows, 1000)["first_crossing"]
    assert (first["signal"], first["limit"]) == ("act_block_spread", "nvfp4 block-scale range")
    assert covers(first["interval"], 60 * math.log(448 * 2**9 / 100))


def test_too_few_log_points_are_unforecastable_never_extrapolated() -> None:
    """A steep trend over MIN_POINTS - 1 points: no crossing, and the signal is named."""
    steps = np.arange(1, MIN_POINTS, dtype=float) * LOG_EVERY
    rows = rows_of({"act_absmax/blocks.0": 2.0**steps}, steps)
    forecast = forecast_run(rows, 10_000)
    assert forecast["first_crossing"] is None
    assert "act_absmax/blocks.0" in forecast["unforecastable"]
    (signal,) = [s for s in forecast["signals"] if s["signal"] == "act_absmax"]
    assert signal["status"] == "unforecastable" and "forecast" not in signal


def write_run(run_dir, rows) -> None:
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_the_command_writes_its_files_beside_the_run_and_a_rerun_replaces_them(tmp_path) -> None:
    """forecast.json holds first_crossing in the stated shape; a second forecast to another
    length replaces the first; the run's own files are untouched."""
    rng = np.random.default_rng(3)
    steps = np.arange(LOG_EVERY, 260, LOG_EVERY, dtype=float)
    rows = rows_of({"act_absmax/blocks.0": growing(steps, rng, 1.0, 0.006, 0.05)}, steps)
    run_dir = tmp_path / "run"
    write_run(run_dir, rows)
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    assert main([str(run_dir), "--steps", "5000"]) == 0
    first = json.loads((run_dir / FORECAST_JSON).read_text())["first_crossing"]
    assert set(first) >= {"step", "interval", "signal", "module", "limit"}
    assert (run_dir / FORECAST_MD).read_text().startswith("# Forecast of run to 5,000 steps")
    if importlib.util.find_spec("matplotlib"):
        # A plot per signal, with its band and the crossing drawn.
        assert (run_dir / "forecast_act_absmax.png").read_bytes().startswith(b"\x89PNG")
    assert main([str(run_dir), "--steps", "600"]) == 0
    forecast = json.loads((run_dir / FORECAST_JSON).read_text())
    assert forecast["planned_steps"] == 600 and forecast["first_crossing"] is None
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics


@pytest.mark.parametrize(
    ("setup", "argv", "says"),
    [
        ("none", ["--steps", "500"], "no metrics.jsonl"),
        ("run", ["--steps", "100"], "not beyond the run's 250 steps"),
        ("link", ["--steps", "500"], "no metrics.jsonl"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, setup, argv, says) -> None:
    """A directory without metrics.jsonl, a planned length not beyond the run, and a
    metrics.jsonl that is a link (a run directory's files are data, read where they are)."""
    steps = np.arange(LOG_EVERY, 260, LOG_EVERY, dtype=float)
    rows = rows_of({"act_absmax/blocks.0": np.ones(len(steps))}, steps)
    run_dir = tmp_path / "run"
    if setup == "none":
        run_dir.mkdir()
    else:
        write_run(run_dir, rows)
    if setup == "link":
        target = tmp_path / "elsewhere.jsonl"
        (run_dir / "metrics.jsonl").rename(target)
        (run_dir / "metrics.jsonl").symlink_to(target)
    assert main([str(run_dir), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err


def test_the_report_gives_each_precision_its_forecast_and_names_the_crossing_run(tmp_path) -> None:
    """Two precisions of one model: the one whose activations grow toward e4m3's range is said
    to cross on its run, the flat one to hold; an unfinished run is left out. Each precision
    gets a plot per signal with its band, of its run that crosses first, linked in report.md."""
    from amp_exp.report.forecasts import forecast_section, long_run_forecasts, plot_forecasts
    from amp_exp.report.runs import Run

    rng = np.random.default_rng(4)
    steps = np.arange(LOG_EVERY, 260, LOG_EVERY, dtype=float)
    growing_rows = rows_of({"act_absmax/blocks.0": growing(steps, rng, 1.0, 0.008, 0.05)}, steps)
    flat_rows = rows_of({"act_absmax/blocks.0": growing(steps, rng, 1.0, 0.0, 0.05)}, steps)

    def run(name: str, precision: str, rows: list[dict], status: str = "completed") -> Run:
        summary = {"status": status, "model": "gpt_tiny", "precision": precision}
        return Run(tmp_path / name, summary, rows)

    runs = [
        run("fp8", "fp8", growing_rows),
        run("bf16", "bf16", flat_rows),
        run("killed", "bf16", growing_rows, status="failed"),
    ]
    forecasts = long_run_forecasts(runs, tmp_path, 2500)
    by_label = {group["label"].split()[0]: group["runs"] for group in forecasts}
    assert [r["run"] for r in by_label["bf16"]] == ["bf16"]
    assert by_label["bf16"][0]["first_crossing"] is None
    assert by_label["fp8"][0]["first_crossing"]["signal"] == "act_absmax"
    text = "\n".join(forecast_section(forecasts))
    assert (
        "**gpt_tiny, fp8 (tensorwise)** to 2,500 steps: a limit is forecast to be crossed on 1 of 1"
        in text
    )
    assert "**gpt_tiny, bf16** to 2,500 steps: no limit is forecast" in text
    # A silence says how likely a crossing is all the same: the flat run's is a far tail.
    assert "the highest chance of one by then: under 1% (act_absmax of blocks.0 on bf16)" in text
    assert "its chance by the planned end: over 99%" in by_label["fp8"][0]["sentence"]
    pytest.importorskip("matplotlib")
    plot_forecasts(forecasts, {run.path.name: run.metrics for run in runs}, tmp_path)
    for group in forecasts:
        assert group["plots"]["run"] == group["label"].split()[0]
        files = group["plots"]["files"]
        assert any("act_absmax" in name for name in files)
        assert all((tmp_path / name).read_bytes().startswith(b"\x89PNG") for name in files)
    text = "\n".join(forecast_section(forecasts))
    assert all(f"]({name})" in text for g in forecasts for name in g["plots"]["files"])
