"""A run's signals forecast to the planned length, and the first limit one is forecast to cross.

**The planned run** is this run's own schedule stretched to N steps: at step n it has the learning
rate this run had at step n·T/N (T: the run's last logged step). **The time axis** is the step:
the trend per step of this run's last regime (after a changepoint) is taken to go on for the
planned run's steps. That is exact for a constant learning rate; under a stretched decaying
schedule each planned step moves the weights less than a step of this run's decay did, so the
forecast errs early rather than late. (The cumulative learning rate was tried as the axis and
dropped: at the end of a decay to zero it compresses the last steps into an instant, and any
drift there becomes a vertical trend.)

**The trend's form** is chosen per signal, over all its points: log-linear growth (a factor per
step) or a straight line, whichever is the likelier model of the values (the Gaussian likelihood
of each, the log model's with its Jacobian; the same number of parameters, so the AIC's pick).

**Limits.** A block's largest activation against the largest value of its format
(``format_max``), its attention logits against the logit at which the softmax saturates
(``attn_logit_limit``; both from the run's signals rows, training/signals.py), and an fp16 loss
scale against ``precision.min_scale``, below which the run stops. Each limited signal is tested
at ``alpha / m`` (Bonferroni over the run's m limited signals), so a run whose signals are all flat
raises a false alarm with probability at most ``alpha``. The other signals are fitted and shown.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np

from amp_exp.config.schema import PrecisionConfig
from amp_exp.forecast.fit import MIN_POINTS, Line, Trend, fit_trend, rss

LEVEL = 0.95
ALPHA = 0.05

PLAN = (
    "this run's schedule stretched to {steps} steps: at step n, the learning rate this run had "
    "at step n*{observed}/{steps}"
)
AXIS = "optimizer steps (the per-step trend of the run's last regime taken to go on)"


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


def _grows_by_factors(x: np.ndarray, values: np.ndarray) -> bool:
    """Whether log-linear growth is the likelier model of all the points than a straight line:
    the Gaussian log-likelihood of each (the log model's with its Jacobian, -sum(log y)), with
    the same number of parameters, so the AIC's pick. Over all the points, each model with one
    line: a changepoint found in one form only would compare them on different spans."""
    logs = np.log(values)
    n = len(x)
    error_straight = rss(x, values) / n
    error_growth = rss(x, logs) / n
    if error_straight == 0 or error_growth == 0:
        return error_growth == 0
    straight_ll = -n / 2 * math.log(error_straight)
    growth_ll = -n / 2 * math.log(error_growth) - float(logs.sum())
    return growth_ll >= straight_ll


def _trend(series: Series) -> tuple[Trend, bool, np.ndarray]:
    """The signal's trend in the form that fits it better (log-linear or straight), whether that
    is log, and the steps of its usable points."""
    finite = np.isfinite(series.values)
    x, values = series.steps[finite], series.values[finite]
    log = (
        series.log
        and len(x) >= MIN_POINTS
        and bool((values > 0).all())
        and _grows_by_factors(x, values)
    )
    return fit_trend(x, np.log(values) if log else values), log, x


def forecast_series(
    series: Series, planned_steps: int, level: float, alpha: float
) -> dict[str, Any]:
    """One signal's fit, forecast at the planned end, and crossing (if forecast) as data."""
    trend, log, x = _trend(series)

    def value(y: float) -> float:
        return math.exp(y) if log else y

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
    centre, low, high = line.prediction(planned_steps, level)
    band = []
    for step in np.linspace(x[trend.start], planned_steps, 40):
        band.append([float(step), *(value(v) for v in line.prediction(float(step), level))])
    out |= {
        "status": "fitted",
        "space": "log" if log else "linear",
        "fit_from_step": float(x[trend.start]),
        "changepoint_p": trend.changepoint_p,
        "slope": line.slope,
        "intercept": line.intercept,
        "residual_sd": line.residual_sd,
        "residual_autocorrelation": line.autocorrelation,
        "forecast": {
            "step": planned_steps,
            "value": value(centre),
            "interval": [value(low), value(high)],
        },
        "band": band,
        "crossing": None,
    }
    if series.limit is not None:
        out["crossing"] = crossing(series, line, log, planned_steps, alpha)
    return out


def crossing(
    series: Series, line: Line, log: bool, planned_steps: int, alpha: float
) -> dict[str, Any] | None:
    """When the trend crosses the limit within the planned run, if its slope heads there at
    level ``alpha`` (one-sided); the interval at 1 - ``alpha``, its end None where the interval
    runs on past every step (``Line.crossing``)."""
    limit = series.limit
    assert limit is not None
    if limit.value <= 0 and log:
        return None
    if line.slope_p(limit.direction) >= alpha:
        return None
    found = line.crossing(math.log(limit.value) if log else limit.value, 1 - alpha)
    if found is None:
        return None
    estimate, low, high = (max(step, 0.0) for step in found)
    if estimate > planned_steps:
        return None
    return {
        "step": estimate,
        "interval": [low, high],
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
    all_series = series_of(rows, min_scale)
    limited = [s for s in all_series if s.limit is not None]
    each_alpha = alpha / max(len(limited), 1)
    signals = [forecast_series(s, planned_steps, level, each_alpha) for s in all_series]
    crossings = [s["crossing"] for s in signals if s.get("crossing")]
    first = min(crossings, key=lambda c: c["step"], default=None)
    return {
        "observed_steps": observed,
        "planned_steps": planned_steps,
        "plan": PLAN.format(steps=planned_steps, observed=observed),
        "axis": AXIS,
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
