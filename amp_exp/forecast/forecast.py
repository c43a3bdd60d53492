"""A run's signals forecast to the planned length, and the first limit one is forecast to cross.

**The planned run** is this run's own schedule stretched to N steps: at step n it has the learning
rate this run had at step n·T/N (T: the run's last logged step). **The time axis** is the
cumulative learning rate (the sum of the rate over steps, from the train rows' ``lr``) where every
train row has one: the weights, and the logits and activations they make, move in proportion to
the rate, so a warm-up or a decay bends a signal's per-step trend but not its trend in this axis.
At planned step n the axis is N/T times this run's at step n·T/N (each stretched step lasts N/T of
this run's). Without the rate the axis is the step, and the trend per step is taken to go on.
Where the rate varies, the step is a second axis beside it: a growth that goes per step whatever
the rate (a factor applied each step) is as plausible a form until the points tell the two apart,
so every form is fitted over both, and both enter the interval; so does the mixed line over both
at once (fit.py), for a growth that is part per unit of rate and part per step.

**The deciding trend** is chosen per signal over all its points: log-linear growth (a factor per
unit of the axis) or a straight line, over either axis or (the mixed line) both, whichever is the
likelier model of the values (the AIC's pick, which charges the mixed line its third parameter);
for a block's activations also the power law of the cumulative rate (growth by a power of it,
as a product of weight matrices moved by bounded steps grows: fit.py); the crossing says which
(``decided_by``). Its rise along the planned run (a line's slope) decides
whether a limit is forecast to be crossed
and its centre gives the step, unless the growth is slowing (``Trend.decider``: the quadratic over
the same points bends away from the limit, one-sided at fit.CHANGEPOINT_ALPHA / 2): then the
quadratic's centre must reach the limit by the planned end, and gives the step.

**The interval** is the hull over every form the data leave plausible (fit.py: line, power law and
quadratic, each in the signal's own and in log space, kept while their relative likelihood is at
least ``fit.PLAUSIBLE``). One form's interval holds only the noise around that form; on real runs
the error of assuming the form goes on dominates (growth that slows is forecast early with an
interval that misses). The quadratic, a trend whose rate drifts steadily, is always plausible
beside its line; its band widens with the square of the horizon, so from a short run the
interval's far end is often past the planned end: the data cannot rule out that growth slows
enough not to cross.

**Limits.** A block's largest activation against the largest value of its format
(``format_max``), its attention logits against the logit at which the softmax saturates
(``attn_logit_limit``), in a block-scaled format the spread of its blocks' maxima against the
range of the block scales (``scale_range``; all from the run's signals rows,
training/signals.py), and an fp16 loss
scale against ``precision.min_scale``, below which the run stops (fitted to the scale's
geometric mean over each log interval where the run logged it, ``scale_mean``). A crossing is
claimed where the deciding line's rise from the last point to the planned end (a line's slope:
the same t-test) differs from zero toward the limit by Holm's step-down test over the run's m
limited signals at family-wise ``alpha`` (two-sided; the intervals are at Bonferroni's
``1 - alpha / m``), so a run whose signals are all flat raises a false alarm with
probability at most ``alpha / 2``. The other signals are fitted and shown.

**The crossing is the first logged value past the limit** (``limit_crossing``): where the run
has logged one already, that step, observed; else the step where the planned run's first read
past it is as likely as not (fit.py ``Fit.passage``), from the deciding trend and the spread of
the reads about it. The engine stops an fp16 run at the first log step whose scale, as read, is
below ``precision.min_scale``, and the reads scatter a level or two about the trend of the
interval means: the first one below comes well before the trend reaches the floor. A read that
takes only a lattice's values (the scale: init_scale times powers of the growth factor) is a
rounded one (``Checked``).

**The chance of each limit's crossing by the planned end** (``crossing_chance``, fit.py
``Fit.chance``), with the interval the true chance lies in at ``1 - alpha / m``, is given for
every limited signal, a crossing named or not: a silence is no promise where the reads scatter
near a limit, and the interval says how little a short run may know of a tail.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.stats

from amp_exp.config.schema import PrecisionConfig
from amp_exp.forecast.fit import MIN_POINTS, Fit, Trend, fit_trend, likeliest_line

LEVEL = 0.95
ALPHA = 0.05

PLAN = (
    "this run's schedule stretched to {steps} steps: at step n, the learning rate this run had "
    "at step n*{observed}/{steps}"
)
AXIS_LR = (
    "the cumulative learning rate (the sum of the learning rate over steps, from the train rows' "
    "lr); the planned run's at step n is N/T times this run's at step n*T/N"
)
AXIS_STEPS = "optimizer steps (the train rows carry no learning rate to sum)"
AXIS_BOTH = (
    "two, each form fitted over both: the cumulative learning rate (the sum of the learning rate "
    "over steps, from the train rows' lr; the planned run's at step n is N/T times this run's at "
    "step n*T/N), for growth per unit of learning rate, and the optimizer step, for growth per "
    "step whatever the rate"
)
# The planned steps each crossing, and its chance, is looked for at.
GRID = 2001


@dataclass(frozen=True)
class Limit:
    name: str
    value: float
    # +1: crossed from below (a range), -1: from above (a floor).
    direction: int


@dataclass(frozen=True)
class Series:
    signal: str
    module: str | None
    steps: np.ndarray
    values: np.ndarray
    limit: Limit | None
    # Fitted in log space (growth by a factor per unit of time), else linearly.
    log: bool
    # What the limit is checked on at each step, where that is not ``values``: the loss scale
    # as read at the log step, against its fitted interval means.
    reads: np.ndarray | None = None

    @property
    def checked(self) -> np.ndarray:
        """What the limit is checked on at each step: the reads where kept, else the values."""
        return self.values if self.reads is None else self.reads


def _series_rows(rows: list[dict[str, Any]]) -> dict[tuple[str, str | None], dict[int, float]]:
    """Each signal's values by step; the scale's reads under the key ("scale read", None)."""
    found: dict[tuple[str, str | None], dict[int, float]] = defaultdict(dict)
    last_skipped = (0, 0)
    for row in sorted(rows, key=lambda row: row["step"]):
        step = row["step"]
        if row["kind"] == "signals":
            for key, value in row.items():
                if "/" in key or key in ("logit_mean", "logit_max"):
                    signal, _, module = key.partition("/")
                    found[(signal, module or None)][step] = value
        elif row["kind"] == "train":
            found[("grad_norm", None)][step] = row.get("grad_norm")
            # The level the scale held over the interval (its geometric mean), where the run
            # logged it: a single read of a scale that flips a level from one log step to the
            # next is mostly that flip (training/skips.py ScaleRecord).
            found[("scale", None)][step] = row.get("scale_mean", row.get("scale"))
            found[READS][step] = row.get("scale")
            skipped = row.get("skipped_steps")
            if isinstance(skipped, int) and step > last_skipped[0]:
                rate = (skipped - last_skipped[1]) / (step - last_skipped[0])
                found[("skip_rate", None)][step] = rate
                last_skipped = (step, skipped)
    return found


def limits_of(rows: list[dict[str, Any]], min_scale: float) -> dict[str, Limit]:
    """Each limited signal's limit, from the latest signals row's facts of the format."""
    facts = next((row for row in reversed(rows) if row["kind"] == "signals"), {})
    limits = {"scale": Limit("precision.min_scale", min_scale, -1)}
    if isinstance(facts.get("format_max"), (int, float)):
        limits["act_absmax"] = Limit(f"{facts.get('format')} range", facts["format_max"], +1)
    if isinstance(facts.get("attn_logit_limit"), (int, float)):
        limits["attn_logit_max"] = Limit("softmax saturation", facts["attn_logit_limit"], +1)
    if isinstance(facts.get("scale_range"), (int, float)):
        name = f"{facts.get('block_format')} block-scale range"
        limits["act_block_spread"] = Limit(name, facts["scale_range"], +1)
    return limits


# Fitted in log space too: what grows or shrinks by factors. The rest (logit_mean, skip_rate, and
# the share act_range_frac, which is act_absmax over a constant) linearly.
LOG_SIGNALS = frozenset(
    {
        "act_absmax",
        "act_block_spread",
        "act_kurtosis",
        "attn_logit_max",
        "update_ratio",
        "grad_norm",
        "scale",
    }
)
# Decided by a line in their own units, as the output logits are fitted: a logit is a log
# already (a difference of two is the log of a ratio of softmax weights, and the saturation limit
# is one) and the product of two weight matrices that the rate moves by about a rate a step, a
# quadratic at most in the cumulative rate. A logit growing by factors, as one does from near 0
# while the weights leave their start, is in that early phase, not on a trend to carry on
# (docs/forecast.md, planted seed 2); the log forms stay in the interval, as every plausible form.
OWN_UNITS = frozenset({"attn_logit_max"})
# Decided by a line in log space only: fp16's GradScaler moves the scale by factors (halved at
# an overflow, doubled after a run of finite steps), so its log2 is what moves by steps and a
# straight fall in its own units, which would reach zero, is no trend it can follow. Its forms
# in its own units stay in the interval, as every plausible form.
FACTOR_UNITS = frozenset({"scale"})
# Made by the weights from fixed data, so grown at most as a polynomial of the cumulative rate
# (fit.py, "Power of the rate"): the power law of the rate, in log space, may decide their trend.
# The loss scale too: the GradScaler holds it near the largest the gradients allow, the inverse
# of their largest element, a product of activations and weights grown so.
POWERS_OF_RATE = frozenset({"act_absmax", "scale"})
# The key the loss scale's reads are kept under, beside its interval means.
READS = ("scale read", None)
# act_absmax's share of the format says the same as act_absmax: not fitted twice.
DERIVED = frozenset({"act_range_frac"})


def _array(points: dict[int, float], steps: list[int]) -> np.ndarray:
    return np.array([math.nan if points.get(s) is None else float(points[s]) for s in steps])


def series_of(rows: list[dict[str, Any]], min_scale: float) -> list[Series]:
    limits = limits_of(rows, min_scale)
    found = _series_rows(rows)
    reads = found.pop(READS, {})
    out = []
    for (signal, module), points in sorted(found.items(), key=lambda i: (i[0][0], i[0][1] or "")):
        if signal in DERIVED or all(v is None for v in points.values()):
            continue
        steps = list(points)
        out.append(
            Series(
                signal,
                module,
                np.array(steps, dtype=float),
                _array(points, steps),
                limits.get(signal),
                signal in LOG_SIGNALS,
                _array(reads, steps) if signal == "scale" else None,
            )
        )
    return out


@dataclass(frozen=True)
class Axis:
    """The fits' time axis: where each step of this run, and of the planned run, lies on it."""

    text: str
    # Short, for a form's description: "cumulative lr" or "step".
    name: str
    # This run's steps (0 first) and the axis's value at each; between them, linear.
    steps: np.ndarray
    values: np.ndarray
    # The planned run's length over this run's.
    stretch: float

    def observed(self, steps: np.ndarray) -> np.ndarray:
        return np.interp(steps, self.steps, self.values)

    def planned(self, steps: np.ndarray) -> np.ndarray:
        """At planned step n the stretched schedule has run as this run had at n / stretch, each
        step of it ``stretch`` times as long: the axis (a sum over steps) is stretch times this
        run's there."""
        return self.stretch * np.interp(np.asarray(steps) / self.stretch, self.steps, self.values)


def axes_of(rows: list[dict[str, Any]], planned_steps: int) -> tuple[Axis, ...]:
    """The fits' candidate time axes: the cumulative learning rate where every train row has one
    (growth of weights and logits scales with it, so a warm-up or a decay bends the per-step
    trend but not this one), and beside it the step where the rate varies (growth that goes per
    step whatever the rate: the forms over both are plausible until the points tell them apart);
    with a constant rate the two are one, and without a rate the step alone. The rate between
    two log steps is taken to move linearly (the trapezoid rule), and before the first log step
    to be the first one's."""
    train = {row["step"]: row.get("lr") for row in rows if row["kind"] == "train"}
    steps = np.array(sorted(train), dtype=float)
    stretch = planned_steps / steps[-1]
    rates = [train[int(step)] for step in steps]
    known = all(isinstance(r, (int, float)) and math.isfinite(r) and r >= 0 for r in rates)
    grid = np.concatenate([[0.0], steps])
    per_step = Axis(AXIS_STEPS, "step", grid, grid, stretch)
    if not known or len(steps) < 2 or sum(rates) == 0:
        return (per_step,)
    lr = np.array([rates[0], *rates], dtype=float)
    cumulative = np.concatenate([[0.0], np.cumsum(np.diff(grid) * (lr[1:] + lr[:-1]) / 2)])
    by_rate = Axis(AXIS_LR, "cumulative lr", grid, cumulative, stretch)
    if np.ptp(lr) == 0:
        return (by_rate,)
    return (Axis(AXIS_BOTH, by_rate.name, grid, cumulative, stretch), per_step)


def _trend(series: Series, axes: tuple[Axis, ...]) -> tuple[Trend, np.ndarray]:
    """The signal's trend (decided by the likeliest line: in log space where that fits better
    and the values allow, over the axis that fits better) and the steps of its usable points."""
    finite = np.isfinite(series.values)
    steps, values = series.steps[finite], series.values[finite]
    us = [axis.observed(steps) for axis in axes]
    try_log = series.log and len(steps) >= MIN_POINTS and bool((values > 0).all())
    if len(steps) < MIN_POINTS:
        return fit_trend(us, values, False, try_log), steps
    if not try_log or series.signal in OWN_UNITS:
        spaces: tuple[bool, ...] = (False,)
    else:
        spaces = (True,) if series.signal in FACTOR_UNITS else (True, False)
    powers = True in spaces and series.signal in POWERS_OF_RATE
    shape, along, log = likeliest_line(us, values, spaces, powers)
    return fit_trend(us, values, log, try_log, shape, along), steps


def _value(form: Fit, y: float | np.ndarray) -> float | np.ndarray:
    if not form.log:
        return y
    # A log form's band far out can pass any float: inf, which forecast.json writes as null.
    with np.errstate(over="ignore"):
        return np.exp(y)


def _hull(
    forms: tuple[Fit, ...], us: list[np.ndarray], level: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The deciding line's forecast at each point (``us``: its places on each axis) and the hull
    of every plausible form's prediction interval there, in the signal's own units."""
    intervals = [[_value(f, v) for v in f.prediction(us, level)] for f in forms]
    low = np.min([i[1] for i in intervals], axis=0)
    return intervals[0][0], low, np.max([i[2] for i in intervals], axis=0)


def _axis_name(form: Fit, axes: tuple[Axis, ...]) -> str:
    return " and ".join(axes[a].name for a in form.axes)


def _describe(form: Fit, axes: tuple[Axis, ...]) -> dict[str, str]:
    return {
        "shape": form.shape,
        "space": "log" if form.log else "linear",
        "axis": _axis_name(form, axes),
    }


def rise_p(
    series: Series, fitted: tuple[Trend, np.ndarray], axes: tuple[Axis, ...], planned_steps: int
) -> float:
    """The two-sided p-value that the deciding line does not move from the last point to the
    planned end, where it moves toward the signal's limit (1 where it has no limit or no line):
    for a one-axis line, whose axis only grows, its slope's t-test; for the mixed line, the test
    of its rise along the planned run."""
    (trend, steps), limit = fitted, series.limit
    if limit is None or trend.line is None:
        return 1.0
    now = [a.observed(steps[-1:]) for a in axes]
    end = [a.planned(np.array([float(planned_steps)])) for a in axes]
    return min(1.0, 2 * trend.line.rise_p(now, end, limit.direction))


def holm(p_values: list[float], alpha: float) -> list[bool]:
    """Which of the hypotheses Holm's step-down procedure rejects at family-wise ``alpha``: the
    smallest p-value against alpha / m, the next against alpha / (m - 1), and so on, stopping at
    the first that is not below. The same family-wise error as Bonferroni's alpha / m, under any
    dependence, and never fewer rejections (Holm 1979)."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    rejected = [False] * len(p_values)
    for rank, index in enumerate(order):
        if p_values[index] >= alpha / (len(p_values) - rank):
            break
        rejected[index] = True
    return rejected


def forecast_series(
    series: Series,
    fitted: tuple[Trend, np.ndarray],
    planned_steps: int,
    level: float,
    alpha: float,
    axes: tuple[Axis, ...],
    claimable: bool,
) -> dict[str, Any]:
    """One signal's fit (``fitted``: its trend and the steps of its usable points), forecast at
    the planned end, and crossing as data: observed, or forecast where ``claimable`` (its line
    moves toward the limit, by the run's multiple test), its interval at 1 - ``alpha``."""
    trend, steps = fitted
    out: dict[str, Any] = {
        "signal": series.signal,
        "module": series.module,
        "points": trend.points,
        "limit": None
        if series.limit is None
        else {"name": series.limit.name, "value": series.limit.value},
        "observed": [
            [float(step), float(v)]
            for step, v in zip(series.steps, series.values, strict=True)
            if math.isfinite(v)
        ],
    }
    if trend.line is None:
        return {**out, "status": "unforecastable", "reason": trend.unforecastable}
    line = trend.line
    # The band's last step is the planned end, where the forecast is read.
    band_steps = np.linspace(steps[trend.start], planned_steps, 40)
    band = np.column_stack(
        [band_steps, *_hull(trend.forms, [a.planned(band_steps) for a in axes], level)]
    )
    _, centre, low, high = (float(v) for v in band[-1])
    out |= {
        "status": "fitted",
        "space": "log" if line.log else "linear",
        "axis": _axis_name(line, axes),
        "fit_from_step": float(steps[trend.start]),
        "changepoint_p": trend.changepoint_p,
        # Per unit of each of the deciding line's axes (two for the mixed line; of the axis's log
        # for the power law: its exponent).
        "slope": {
            ("log " if line.shape == "power" else "") + axes[a].name: v
            for a, v in zip(line.axes, line.slopes, strict=True)
        },
        "intercept": line.intercept,
        "residual_sd": line.residual_sd,
        "residual_autocorrelation": line.autocorrelation,
        "forms": [_describe(f, axes) | {"aic": f.aic} for f in trend.forms],
        "forecast": {"step": planned_steps, "value": centre, "interval": [low, high]},
        "band": band.tolist(),
        "crossing": None,
    }
    if series.limit is not None:
        out["crossing"] = limit_crossing(series, fitted, axes, planned_steps, alpha, claimable)
        out["chance"] = crossing_chance(series, fitted, axes, planned_steps, alpha)
        if out["crossing"] is not None:
            out["crossing"]["chance"] = out["chance"]
    return out


@dataclass(frozen=True)
class Future:
    """The planned run from the fitted points' start to its end, on a grid of steps: the grid's
    places on every axis (``us``), the values the limit is checked on at the fitted points
    (``checked``: their spread about a trend is the reads' noise) and the number of the planned
    run's log reads each grid point stands for (``reads``: its share of those after this run's
    last, at this run's log interval; none before: this run has read them)."""

    steps: np.ndarray
    us: list[np.ndarray]
    checked: Checked
    reads: np.ndarray


def future_of(
    series: Series, fitted: tuple[Trend, np.ndarray], axes: tuple[Axis, ...], planned_steps: int
) -> Future:
    trend, steps = fitted
    grid = np.linspace(steps[trend.start], planned_steps, GRID)
    at_fitted = series.checked[np.isfinite(series.values)][trend.start :]
    known = np.isfinite(at_fitted)
    spread = Checked([a.observed(steps[trend.start :])[known] for a in axes], at_fitted[known])
    log_every = float(np.median(np.diff(series.steps))) if len(series.steps) > 1 else 1.0
    reads = np.where(grid > steps[-1], (grid[1] - grid[0]) / log_every, 0.0)
    return Future(grid, [a.planned(grid) for a in axes], spread, reads)


def first_past(series: Series) -> float | None:
    """The first step whose value the limit is checked on (the loss scale: its read) is past it,
    or None."""
    assert series.limit is not None
    past = np.flatnonzero(series.limit.direction * (series.checked - series.limit.value) > 0)
    return float(series.steps[past[0]]) if past.size else None


def limit_crossing(
    series: Series,
    fitted: tuple[Trend, np.ndarray],
    axes: tuple[Axis, ...],
    planned_steps: int,
    alpha: float,
    claimable: bool,
) -> dict[str, Any] | None:
    """The signal's crossing of its limit: observed, where a value the limit is checked on is
    already past it (the first such step), else, where ``claimable``, forecast (``crossing``)
    over the planned steps after the fitted points' start."""
    trend, limit = fitted[0], series.limit
    assert limit is not None
    step = first_past(series)
    if step is not None:
        found: dict[str, Any] | None = {"step": step, "interval": [step, step], "observed": True}
        return found | _limit_fields(series) | {"decided_by": None}
    if not claimable:
        return None
    future = future_of(series, fitted, axes, planned_steps)
    found = crossing(series, trend, future.steps, future.us, alpha, future.checked, future.reads)
    if found is not None:
        found["decided_by"] = _describe(trend.decider(limit.direction), axes)
    return found


def crossing_chance(
    series: Series,
    fitted: tuple[Trend, np.ndarray],
    axes: tuple[Axis, ...],
    planned_steps: int,
    alpha: float,
) -> dict[str, Any]:
    """The chance that the planned run logs a value past the signal's limit by its end, under
    the deciding trend and the reads' spread about it, and the interval the true chance lies in
    at 1 - ``alpha``: the hull of every plausible form's (``Fit.chance``), as the crossing's
    interval is; 1 where this run already has. Whether or not a crossing is claimed: a flat
    signal near its limit may pass it on its scatter alone."""
    trend, limit = fitted[0], series.limit
    assert limit is not None and trend.line is not None
    if first_past(series) is not None:
        return {"value": 1.0, "interval": [1.0, 1.0]}
    future = future_of(series, fitted, axes, planned_steps)
    decider = trend.decider(limit.direction)
    value, lows, highs = 0.0, [], []
    for form in hull_forms(trend, decider):
        boundary = future.checked.boundary(limit, form.log)
        if boundary is None:
            continue
        sds = future.checked.sds(form, 1 - alpha / 2)
        chance, low, high = form.chance(
            future.us, boundary, limit.direction, sds, future.reads, 1 - alpha
        )
        value = chance if form is decider else value
        lows.append(low)
        highs.append(high)
    return {"value": value, "interval": [min(lows, default=0.0), max(highs, default=0.0)]}


def hull_forms(trend: Trend, decider: Fit) -> tuple[Fit, ...]:
    """The forms whose hull is an interval: every plausible one, and the decider (an implausible
    form is no part of it, unless it decides)."""
    return trend.forms if any(f is decider for f in trend.forms) else (*trend.forms, decider)


def _limit_fields(series: Series) -> dict[str, Any]:
    assert series.limit is not None
    return {
        "signal": series.signal,
        "module": series.module,
        "limit": series.limit.name,
        "limit_value": series.limit.value,
    }


def lattice_of(values: np.ndarray) -> float | None:
    """The spacing, in log units, of the one lattice of factors every positive value lies on
    (values that move only by a factor and its inverse, as fp16's GradScaler moves the scale by
    its growth factor and backs off by its inverse: powers of two times init_scale by default),
    or None where they lie on none (or take fewer than two values)."""
    known = values[np.isfinite(values) & (values > 0)]
    logs = np.unique(np.round(np.log(known), 9))
    if len(logs) < 2:
        return None
    spacing = float(np.diff(logs).min())
    steps = (logs - logs[0]) / spacing
    return spacing if np.allclose(steps, np.round(steps), atol=1e-6) else None


@dataclass(frozen=True)
class Checked:
    """The values a limit is checked on at the fitted points, and those points' places on every
    axis: their spread about a form's trend is the reads' noise (``Fit.read_sd``). Reads that
    take only the values of a lattice of factors (``lattice_of``) are a continuous read rounded
    to it: a read is past the limit where the continuous one is past the midpoint between the
    lattice's last value short of the limit and its first past it, and the continuous read's
    spread is the rounded reads' less the rounding's (Sheppard's correction: spacing^2 / 12)."""

    us: list[np.ndarray]
    values: np.ndarray

    @functools.cached_property
    def lattice(self) -> float | None:
        return lattice_of(self.values)

    def _spread(self, form: Fit) -> tuple[float, float]:
        return form.read_spread(self.us, np.log(self.values) if form.log else self.values)

    def _continuous(self, form: Fit, sd: float) -> float:
        """The continuous read's spread, where ``sd`` is the rounded reads' (Sheppard)."""
        if form.log and self.lattice is not None:
            return math.sqrt(max(sd**2 - self.lattice**2 / 12, 0.0))
        return sd

    def sd(self, form: Fit) -> float:
        return self._continuous(form, self._spread(form)[0])

    def sds(self, form: Fit, level: float) -> tuple[float, float, float]:
        """The reads' spread about ``form``'s trend, and the interval the true spread lies in at
        ``level`` (chi-square, on the reads' degrees of freedom: ``Fit.read_spread``)."""
        sd, dof = self._spread(form)
        tail = (1 - level) / 2
        spreads = (
            sd,
            sd * math.sqrt(dof / scipy.stats.chi2.isf(tail, dof)),
            sd * math.sqrt(dof / scipy.stats.chi2.ppf(tail, dof)),
        )
        return tuple(self._continuous(form, s) for s in spreads)

    def boundary(self, limit: Limit, log: bool) -> float | None:
        """Where a form in log space (``log``) or in the values' own units has a read cross
        ``limit``; None where a log form never can (a limit of 0 or below)."""
        if limit.value <= 0:
            return None if log else limit.value
        value = math.log(limit.value)
        if self.lattice is not None:
            origin = math.log(self.values[np.isfinite(self.values)][0])
            # Lattice values counted from the first read toward the limit: the last one short
            # of it (one on it is not past it: the check is strict).
            short = math.floor((value - origin) / self.lattice * limit.direction + 1e-9)
            value = origin + limit.direction * (short + 0.5) * self.lattice
        return value if log else math.exp(value)


def crossing(
    series: Series,
    trend: Trend,
    steps: np.ndarray,
    us: list[np.ndarray],
    alpha: float,
    checked: Checked,
    reads: np.ndarray,
) -> dict[str, Any] | None:
    """When the deciding trend crosses the limit within the planned run (``steps``, at ``us`` on
    each axis), for a signal whose line moves toward it (``rise_p``, the caller's test). The
    deciding trend is the line, or its
    quadratic where that bends significantly away from the limit (``Trend.decider``: growth
    that has slowed is not carried forward at its average rate). The interval, at
    1 - ``alpha``, is the hull of every plausible form's crossing set (the decider's
    included): from the first step the band of any of them reaches the limit to the first step
    all of them are surely past it (None where one is not by the planned end)."""
    limit = series.limit
    assert limit is not None and trend.line is not None
    decider = trend.decider(limit.direction)
    lows, highs = [], []
    estimate = None
    for form in hull_forms(trend, decider):
        boundary = checked.boundary(limit, form.log)
        if boundary is None:
            continue
        centre, near, far = form.passage(
            us, boundary, limit.direction, 1 - alpha, checked.sd(form), reads
        )
        if form is decider:
            if centre is None:
                return None
            estimate = float(steps[centre])
        if near is not None:
            lows.append(float(steps[near]))
        highs.append(None if far is None else float(steps[far]))
    if estimate is None:
        return None
    interval = [min(lows), None if None in highs else max(highs)]
    return {"step": estimate, "interval": interval, "observed": False} | _limit_fields(series)


def forecast_run(
    rows: list[dict[str, Any]],
    planned_steps: int,
    min_scale: float = PrecisionConfig.min_scale,
    level: float = LEVEL,
    alpha: float = ALPHA,
) -> dict[str, Any]:
    """The run's forecast to ``planned_steps``: every signal's fit, and the first crossing."""
    observed = max(row["step"] for row in rows if row["kind"] == "train")
    axes = axes_of(rows, planned_steps)
    all_series = series_of(rows, min_scale)
    fits = [_trend(s, axes) for s in all_series]
    limited = [i for i, s in enumerate(all_series) if s.limit is not None]
    # Which limited signals move toward their limits: Holm's step-down over them, family-wise
    # alpha; the intervals stay at Bonferroni's simultaneous 1 - alpha / m.
    moving = holm([rise_p(all_series[i], fits[i], axes, planned_steps) for i in limited], alpha)
    claimable = {i for i, rejected in zip(limited, moving, strict=True) if rejected}
    each_alpha = alpha / max(len(limited), 1)
    signals = [
        forecast_series(s, fit, planned_steps, level, each_alpha, axes, i in claimable)
        for i, (s, fit) in enumerate(zip(all_series, fits, strict=True))
    ]
    crossings = [s["crossing"] for s in signals if s.get("crossing")]
    first = min(crossings, key=lambda c: c["step"], default=None)
    likeliest = max(
        (s for s in signals if s.get("chance") is not None),
        key=lambda s: s["chance"]["value"],
        default=None,
    )
    return {
        "observed_steps": observed,
        "planned_steps": planned_steps,
        "plan": PLAN.format(steps=planned_steps, observed=observed),
        "axis": axes[0].text,
        "level": level,
        "familywise_alpha": alpha,
        "first_crossing": first,
        "likeliest_crossing": None
        if likeliest is None
        else {
            "signal": likeliest["signal"],
            "module": likeliest["module"],
            "limit": likeliest["limit"]["name"],
            "chance": likeliest["chance"],
        },
        "unforecastable": [
            _name(s) for s in signals if s["status"] == "unforecastable" and s["limit"]
        ],
        "signals": signals,
    }


def _name(signal: dict[str, Any]) -> str:
    return signal["signal"] + (f"/{signal['module']}" if signal["module"] else "")
