"""A run's signals forecast to the planned length, and the first limit one is forecast to cross.

**The planned run** is this run's own schedule stretched to N steps: at step n it has the learning
rate this run had at step n·T/N (T: the run's last logged step). **The time axis** is the
cumulative learning rate (the sum of the rate over steps, from the train rows' ``lr``) where every
train row has one: the weights, and the logits and activations they make, move in proportion to
the rate, so a warm-up or a decay bends a signal's per-step trend but not its trend in this axis.
At planned step n the axis is N/T times this run's at step n·T/N (each stretched step lasts N/T of
this run's). Without the rate the axis is the step, and the trend per step is taken to go on.

**The deciding trend** is chosen per signal over all its points: log-linear growth (a factor per
unit of the axis) or a straight line, whichever is the likelier model of the values (the AIC's
pick: the same number of parameters). Its slope decides whether a limit is forecast to be crossed
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
(``attn_logit_limit``; both from the run's signals rows, training/signals.py), and an fp16 loss
scale against ``precision.min_scale``, below which the run stops. A crossing is claimed where the
deciding line's slope differs from zero at a two-sided ``alpha / m`` toward the limit (Bonferroni
over the run's m limited signals), so a run whose signals are all flat raises a false alarm with
probability at most ``alpha / 2``. The other signals are fitted and shown.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

from amp_exp.config.schema import PrecisionConfig
from amp_exp.forecast.fit import MIN_POINTS, Fit, Trend, fit_trend, grows_by_factors

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
# The planned steps each crossing is looked for at.
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


def _series_rows(rows: list[dict[str, Any]]) -> dict[tuple[str, str | None], dict[int, float]]:
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
            for key in ("grad_norm", "scale"):
                found[(key, None)][step] = row.get(key)
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
    return limits


# Fitted in log space: what grows or shrinks by factors. The rest (logit_mean, skip_rate, and
# the share act_range_frac, which is act_absmax over a constant) linearly.
LOG_SIGNALS = frozenset(
    {"act_absmax", "act_kurtosis", "attn_logit_max", "update_ratio", "grad_norm", "scale"}
)
# act_absmax's share of the format says the same as act_absmax: not fitted twice.
DERIVED = frozenset({"act_range_frac"})


def series_of(rows: list[dict[str, Any]], min_scale: float) -> list[Series]:
    limits = limits_of(rows, min_scale)
    out = []
    for (signal, module), points in sorted(
        _series_rows(rows).items(), key=lambda item: (item[0][0], item[0][1] or "")
    ):
        if signal in DERIVED or all(v is None for v in points.values()):
            continue
        steps = np.array(list(points), dtype=float)
        values = np.array([math.nan if v is None else float(v) for v in points.values()])
        out.append(Series(signal, module, steps, values, limits.get(signal), signal in LOG_SIGNALS))
    return out


@dataclass(frozen=True)
class Axis:
    """The fits' time axis: where each step of this run, and of the planned run, lies on it."""

    text: str
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


def axis_of(rows: list[dict[str, Any]], planned_steps: int) -> Axis:
    """The cumulative learning rate where every train row has one (growth of weights and logits
    scales with it, so a warm-up or a decay bends the per-step trend but not this one); else the
    step. The rate between two log steps is taken to move linearly (the trapezoid rule), and
    before the first log step to be the first one's."""
    train = {row["step"]: row.get("lr") for row in rows if row["kind"] == "train"}
    steps = np.array(sorted(train), dtype=float)
    stretch = planned_steps / steps[-1]
    rates = [train[int(step)] for step in steps]
    known = all(isinstance(r, (int, float)) and math.isfinite(r) and r >= 0 for r in rates)
    if not known or len(steps) < 2 or sum(rates) == 0:
        grid = np.concatenate([[0.0], steps])
        return Axis(AXIS_STEPS, grid, grid, stretch)
    lr = np.array([rates[0], *rates], dtype=float)
    grid = np.concatenate([[0.0], steps])
    cumulative = np.concatenate([[0.0], np.cumsum(np.diff(grid) * (lr[1:] + lr[:-1]) / 2)])
    return Axis(AXIS_LR, grid, cumulative, stretch)


def _trend(series: Series, axis: Axis) -> tuple[Trend, np.ndarray]:
    """The signal's trend (in log space where that fits better and the values allow) and the
    steps of its usable points."""
    finite = np.isfinite(series.values)
    steps, values = series.steps[finite], series.values[finite]
    u = axis.observed(steps)
    try_log = series.log and len(u) >= MIN_POINTS and bool((values > 0).all())
    log = try_log and grows_by_factors(u, values)
    return fit_trend(u, values, log, try_log), steps


def _value(form: Fit, y: float | np.ndarray) -> float | np.ndarray:
    if not form.log:
        return y
    # A log form's band far out can pass any float: inf, which forecast.json writes as null.
    with np.errstate(over="ignore"):
        return np.exp(y)


def _hull(forms: tuple[Fit, ...], u: float, level: float) -> tuple[float, float, float]:
    """The deciding line's forecast at ``u`` and the hull of every plausible form's prediction
    interval there, in the signal's own units."""
    intervals = [[float(_value(f, v)) for v in f.prediction(u, level)] for f in forms]
    return intervals[0][0], min(i[1] for i in intervals), max(i[2] for i in intervals)


def forecast_series(
    series: Series, planned_steps: int, level: float, alpha: float, axis: Axis
) -> dict[str, Any]:
    """One signal's fit, forecast at the planned end, and crossing (if forecast) as data."""
    trend, steps = _trend(series, axis)
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
    end = float(axis.planned(np.array([planned_steps]))[0])
    centre, low, high = _hull(trend.forms, end, level)
    band = []
    for step in np.linspace(steps[trend.start], planned_steps, 40):
        u = float(axis.planned(np.array([step]))[0])
        band.append([float(step), *_hull(trend.forms, u, level)])
    out |= {
        "status": "fitted",
        "space": "log" if line.log else "linear",
        "fit_from_step": float(steps[trend.start]),
        "changepoint_p": trend.changepoint_p,
        "slope": line.slope,
        "intercept": line.intercept,
        "residual_sd": line.residual_sd,
        "residual_autocorrelation": line.autocorrelation,
        "forms": [
            {"shape": f.shape, "space": "log" if f.log else "linear", "aic": f.aic}
            for f in trend.forms
        ],
        "forecast": {"step": planned_steps, "value": centre, "interval": [low, high]},
        "band": band,
        "crossing": None,
    }
    if series.limit is not None:
        grid = np.linspace(steps[trend.start], planned_steps, GRID)
        out["crossing"] = crossing(series, trend, grid, axis.planned(grid), alpha)
    return out


def crossing(
    series: Series, trend: Trend, steps: np.ndarray, u: np.ndarray, alpha: float
) -> dict[str, Any] | None:
    """When the deciding trend crosses the limit within the planned run (``steps``, at ``u`` on
    the axis), if the line's slope differs from zero toward it at a two-sided ``alpha`` (as
    Fieller's interval of the line is bounded). The deciding trend is the line, or its
    quadratic where that bends significantly away from the limit (``Trend.decider``: growth
    that has slowed is not carried forward at its average rate). The interval, at
    1 - ``alpha``, is the hull of every plausible form's crossing set (the decider's
    included): from the first step the band of any of them reaches the limit to the first step
    all of them are surely past it (None where one is not by the planned end)."""
    limit, line = series.limit, trend.line
    assert limit is not None and line is not None
    if line.slope_p(limit.direction) >= alpha / 2:
        return None
    decider = trend.decider(limit.direction)
    # An implausible form's band is no part of the hull, unless it decides.
    forms = trend.forms if any(f is decider for f in trend.forms) else (*trend.forms, decider)
    lows, highs = [], []
    estimate = None
    for form in forms:
        if form.log and limit.value <= 0:
            continue
        value = math.log(limit.value) if form.log else limit.value
        centre, near, far = form.crossing(u, value, limit.direction, 1 - alpha)
        if form is decider:
            if centre is None:
                return None
            estimate = float(steps[centre])
        if near is not None:
            lows.append(float(steps[near]))
        highs.append(None if far is None else float(steps[far]))
    if estimate is None:
        return None
    return {
        "step": estimate,
        "interval": [min(lows), None if None in highs else max(highs)],
        "signal": series.signal,
        "module": series.module,
        "limit": limit.name,
        "limit_value": limit.value,
    }


def forecast_run(
    rows: list[dict[str, Any]],
    planned_steps: int,
    min_scale: float = PrecisionConfig.min_scale,
    level: float = LEVEL,
    alpha: float = ALPHA,
) -> dict[str, Any]:
    """The run's forecast to ``planned_steps``: every signal's fit, and the first crossing."""
    observed = max(row["step"] for row in rows if row["kind"] == "train")
    axis = axis_of(rows, planned_steps)
    all_series = series_of(rows, min_scale)
    limited = [s for s in all_series if s.limit is not None]
    each_alpha = alpha / max(len(limited), 1)
    signals = [forecast_series(s, planned_steps, level, each_alpha, axis) for s in all_series]
    crossings = [s["crossing"] for s in signals if s.get("crossing")]
    first = min(crossings, key=lambda c: c["step"], default=None)
    return {
        "observed_steps": observed,
        "planned_steps": planned_steps,
        "plan": PLAN.format(steps=planned_steps, observed=observed),
        "axis": axis.text,
        "level": level,
        "familywise_alpha": alpha,
        "first_crossing": first,
        "unforecastable": [
            _name(s) for s in signals if s["status"] == "unforecastable" and s["limit"]
        ],
        "signals": signals,
    }


def _name(signal: dict[str, Any]) -> str:
    return signal["signal"] + (f"/{signal['module']}" if signal["module"] else "")
