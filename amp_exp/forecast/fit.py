"""One signal's trend: least-squares fits of a few growth forms over one or more time axes, after
a changepoint test, with their bands and where each meets a limit.

- **Forms.** In the signal's own space or in log space (growth by factors), each of: a line in
  the axis ``u``, a power law (a line in log ``u``) and a quadratic (a line whose slope drifts
  steadily: growth that speeds up or slows down); each over every candidate axis (forecast.py:
  the cumulative learning rate, and the step where the rate varies). ``AIC`` compares them on
  the values, the log forms' likelihoods with their Jacobian, so forms fitted in different spaces
  or over different axes are comparable.
- **Changepoint.** A run's signals often move fast early (warm-up, the first steps of a loss
  scale) and settle into a slower trend; extrapolating the whole run would carry the early
  slope forward. Every break that leaves ``MIN_POINTS`` and a quarter of every axis's span on
  each side is tested with a Chow F-test (two lines against one); the smallest p-value,
  Bonferroni-corrected over the breaks tried, below ``CHANGEPOINT_ALPHA`` keeps only the points
  after it. (The span matters where the axis is the cumulative learning rate: at the end of a
  decay to zero many log steps sit at almost one value of it, and a few drifting points there
  would make a vertical trend.)
- **Autocorrelation.** Training signals are not independent from one log step to the next. The
  residuals' lag-1 autocorrelation rho (0 or more) widens every interval by sqrt((1+rho)/(1-rho))
  and cuts the degrees of freedom to the effective sample size, the AR(1) correction.
- **Crossing.** Where a form's trend meets the limit ``L``: the set of axis values where L lies
  inside the trend's pointwise confidence band. At the true crossing ``(trend - L) / se`` is
  t-distributed, so the set covers it at the stated level (Fieller 1954, here on a grid so that
  every form is treated alike).
- **Slowing.** A line carries its rate forward for good. Where the quadratic over the same
  points (after any changepoint) bends away from the limit, one-sided at the changepoint test's
  level, the growth is slowing more than noise would make it look, and the quadratic decides
  instead: a crossing is claimed only if it reaches the limit by the planned end. Healthy runs'
  attention logits grow fast early and level off (docs/forecast.md); the line through them
  crossed the limit, the quadratic does not. (Over the points of the regime the changepoint
  keeps only: a later regime that grows steadily after a fast start is extrapolated, as one real
  run that took off later showed it should be.)
- **Too few points** (fewer than ``MIN_POINTS`` usable values) are ``unforecastable``: nothing is
  extrapolated from them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import scipy.stats

MIN_POINTS = 6
CHANGEPOINT_ALPHA = 0.01
MAX_AUTOCORRELATION = 0.9
# The least share of the axis's span a changepoint leaves on either side of it.
MIN_SPAN = 0.25
SHAPES = ("line", "power", "quadratic")


@functools.lru_cache(maxsize=4096)
def _t_quantile(q: float, dof: float) -> float:
    # scipy's quantile costs tens of microseconds; a forecast asks for a few, many times over.
    return float(scipy.stats.t.ppf(q, dof))


@dataclass(frozen=True)
class Fit:
    """A least-squares fit of one form with what its bands need. The design is in ``z``, the
    axis centred and scaled over the fitted points (the quadratic's columns stay comparable), or
    log ``u`` for the power law."""

    shape: str
    log: bool
    coefficients: np.ndarray
    # The coefficients' covariance, times the AR(1) inflation.
    covariance: np.ndarray
    centre: float
    scale: float
    n: int
    dof: float
    autocorrelation: float
    residual_sd: float
    aic: float
    # Which of the candidate time axes ``u`` is on (an index into the caller's list).
    axis: int = 0

    def design(self, u: np.ndarray) -> np.ndarray:
        u = np.atleast_1d(np.asarray(u, dtype=float))
        if self.shape == "power":
            return np.column_stack([np.ones_like(u), np.log(u)])
        z = (u - self.centre) / self.scale
        columns = [np.ones_like(z), z] + ([z * z] if self.shape == "quadratic" else [])
        return np.column_stack(columns)

    @property
    def slope(self) -> float:
        """The trend's slope per unit of the axis at the centre of the fitted points (per unit of
        log ``u`` for the power law)."""
        return float(self.coefficients[1]) / (1.0 if self.shape == "power" else self.scale)

    @property
    def intercept(self) -> float:
        """The trend at u = 0 (log u = 0 for the power law)."""
        return float(self.at(np.array([1.0 if self.shape == "power" else 0.0]))[0])

    def at(self, u: np.ndarray) -> np.ndarray:
        return self.design(u) @ self.coefficients

    def t(self, level: float) -> float:
        return _t_quantile(0.5 + level / 2, self.dof)

    def _trend_variance(self, u: np.ndarray) -> np.ndarray:
        design = self.design(u)
        return np.einsum("ij,jk,ik->i", design, self.covariance, design)

    def confidence(self, u: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
        """The band the trend itself at each ``u`` lies in."""
        centre, half = self.at(u), self.t(level) * np.sqrt(self._trend_variance(u))
        return centre - half, centre + half

    def prediction(self, u: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The trend at each ``u`` and the interval a new observation there falls in."""
        noise = self.residual_sd**2 * (1 + self.autocorrelation) / (1 - self.autocorrelation)
        centre = self.at(u)
        half = self.t(level) * np.sqrt(self._trend_variance(u) + noise)
        return centre, centre - half, centre + half

    def _coefficient_p(self, index: int, towards: float) -> float:
        se = math.sqrt(self.covariance[index, index])
        if se == 0:
            return 0.0 if self.coefficients[index] * towards > 0 else 1.0
        return float(scipy.stats.t.sf(towards * self.coefficients[index] / se, self.dof))

    def slope_p(self, towards: float) -> float:
        """One-sided p-value that the slope is 0 against it moving ``towards`` (+1 or -1)."""
        return self._coefficient_p(1, towards)

    def bend_p(self, towards: float) -> float:
        """A quadratic's one-sided p-value that its curvature is 0 against the trend bending
        ``towards`` (+1: up, -1: down)."""
        return self._coefficient_p(2, towards)

    def crossing(
        self, u: np.ndarray, limit: float, direction: int, level: float
    ) -> tuple[int | None, int | None, int | None]:
        """Indices into the increasing grid ``u``: where the trend first reaches ``limit``
        (crossed from below for ``direction`` +1, from above for -1), where the band's near edge
        first does (the earliest crossing the band allows) and where its far edge does (past
        which the limit is surely crossed); None where it does not within the grid."""
        low, high = self.confidence(u, level)
        near, far = (high, low) if direction > 0 else (-low, -high)
        reached = [direction * self.at(u) >= direction * limit, near >= direction * limit]
        reached.append(far >= direction * limit)
        return tuple(int(np.argmax(r)) if r.any() else None for r in reached)


def fit_form(shape: str, log: bool, u: np.ndarray, values: np.ndarray, axis: int = 0) -> Fit:
    """The least-squares fit of ``values`` (positive where ``log``) in one form over ``u`` (the
    candidate axis ``axis``)."""
    y = np.log(values) if log else values
    centre, scale = float(u.mean()), float(np.ptp(u) / 2) or 1.0
    probe = Fit(shape, log, np.zeros(0), np.zeros((0, 0)), centre, scale, 0, 1, 0, 0, 0)
    design = probe.design(u)
    n, k = design.shape
    coefficients, _, _, _ = np.linalg.lstsq(design, y, rcond=None)
    residuals = y - design @ coefficients
    rss = float(residuals @ residuals)
    rho = float(residuals[1:] @ residuals[:-1]) / rss if n > 2 and rss > 0 else 0.0
    rho = min(max(rho, 0.0), MAX_AUTOCORRELATION)
    inflation = (1 + rho) / (1 - rho)
    variance = rss / max(n - k, 1)
    covariance = variance * inflation * np.linalg.pinv(design.T @ design)
    # The Gaussian likelihood of the values: a log form's carries its Jacobian, -sum(log y).
    log_likelihood = -n / 2 * math.log(max(rss, 1e-300) / n) - (float(y.sum()) if log else 0.0)
    return Fit(
        shape=shape,
        log=log,
        coefficients=coefficients,
        covariance=covariance,
        centre=centre,
        scale=scale,
        n=n,
        dof=max(n / inflation - k, 1.0),
        autocorrelation=rho,
        residual_sd=math.sqrt(variance),
        aic=2 * k - 2 * log_likelihood,
        axis=axis,
    )


def rss(x: np.ndarray, y: np.ndarray) -> float:
    """The residual sum of squares of the least-squares line (closed form: many are needed)."""
    dx, dy = x - x.mean(), y - y.mean()
    sxx = dx @ dx
    return float(dy @ dy - (dx @ dy) ** 2 / sxx) if sxx > 0 else float(dy @ dy)


def changepoint(
    x: np.ndarray, y: np.ndarray, axes: tuple[np.ndarray, ...] = ()
) -> tuple[int | None, float | None]:
    """The index the later regime starts at, or None, and the Bonferroni-corrected p-value of
    the best break (None where the series is too short to try one). A break leaves a quarter
    of the span of ``x`` and of every other axis in ``axes`` on each side: the forms over each
    axis are fitted to the points after it."""
    n = len(x)

    def spans(k: int) -> bool:
        return all(
            min(u[k - 1] - u[0], u[-1] - u[k]) >= MIN_SPAN * (u[-1] - u[0]) for u in (x, *axes)
        )

    breaks = [k for k in range(MIN_POINTS, n - MIN_POINTS + 1) if spans(k)]
    if not breaks or n <= 4:
        return None, None
    whole = rss(x, y)
    split = np.array([rss(x[:k], y[:k]) + rss(x[k:], y[k:]) for k in breaks])
    # One call for every break: scipy's survival function costs more than the sums of squares.
    with np.errstate(divide="ignore", invalid="ignore"):
        p = scipy.stats.f.sf(((whole - split) / 2) / (split / (n - 4)), 2, n - 4)
    p = np.where(split > 0, p, 0.0 if whole > 0 else 1.0)
    best = int(np.argmin(p))
    corrected = min(1.0, float(p[best]) * len(breaks))
    return (breaks[best] if corrected < CHANGEPOINT_ALPHA else None), corrected


def likeliest_line(axes: list[np.ndarray], values: np.ndarray, try_log: bool) -> tuple[int, bool]:
    """The axis and the space (log: growth by factors) of the line that is the likeliest model
    of all the points (the same number of parameters, so the AIC's pick; a tie goes to log space
    and to the first axis). Over all the points, each line alike: a changepoint found for one
    only would compare them on different spans. The first axis is the method's (forecast.py:
    the cumulative rate); a later one (the step) is an alternative that decides only where its
    line holds over all the points: its quadratic bends neither way at the changepoint test's
    level. A growth per step whatever the rate goes on alike through warm-up, peak and decay; a
    rise that starts late in a decay to zero is no such growth."""
    spaces = (True, False) if try_log else (False,)

    def holds(axis: int, log: bool) -> bool:
        bend = fit_form("quadratic", log, axes[axis], values)
        return min(bend.bend_p(+1), bend.bend_p(-1)) >= CHANGEPOINT_ALPHA / 2

    candidates = [
        (axis, log) for axis in range(len(axes)) for log in spaces if axis == 0 or holds(axis, log)
    ]
    return min(candidates, key=lambda c: fit_form("line", c[1], axes[c[0]], values).aic)


@dataclass(frozen=True)
class Trend:
    """A signal's fitted trend, or why it has none: ``line``, the form that decides (a line, in
    log space where that fits better), and ``forms``, every form still plausible beside it
    (the line included), whose hull is the crossing's interval."""

    line: Fit | None
    # The number of usable points, and the index of the first one the fits start at.
    points: int
    start: int = 0
    changepoint_p: float | None = None
    unforecastable: str | None = None
    forms: tuple[Fit, ...] = ()
    # The quadratic in the deciding line's space, over the same points: whether the growth is
    # slowing (``decider``).
    bend: Fit | None = None

    def decider(self, direction: int, alpha: float = CHANGEPOINT_ALPHA) -> Fit:
        """The form whose trend decides a crossing toward a limit in ``direction``: the line,
        unless its quadratic over the same points bends away from the limit at one-sided
        ``alpha / 2`` (the changepoint test's level: growth slowing more than noise would make
        it look), when the line would carry forward a rate the run has already left behind, and
        the quadratic decides. Where the line holds, the quadratic replaces it with probability
        at most ``alpha / 2``."""
        assert self.line is not None and self.bend is not None
        return self.bend if self.bend.bend_p(-direction) < alpha / 2 else self.line


# A form is kept beside the best while its likelihood is at least this share of the best's
# (Akaike's relative likelihood, exp(-dAIC/2)): a form the data all but rule out widens nothing.
PLAUSIBLE = 0.05


def fit_trend(
    axes: list[np.ndarray], values: np.ndarray, log: bool, try_log: bool, axis: int = 0
) -> Trend:
    """The trend of ``values`` (only usable points) over the candidate time ``axes`` (each the
    points' places on one axis), fitted after the changepoint found for the deciding line: in
    log space where ``log``, over ``axes[axis]``; ``try_log``: the log forms are candidates too
    (the values are positive and may grow by factors). Every form is fitted over the same
    points, after that changepoint, on every axis."""
    n = len(values)
    if n < MIN_POINTS:
        return Trend(None, n, unforecastable=f"{n} usable log points, fewer than {MIN_POINTS}")
    if np.ptp(axes[axis]) == 0:
        return Trend(None, n, unforecastable="every point is at the same place on the time axis")
    start, p = changepoint(axes[axis], np.log(values) if log else values, tuple(axes))
    start = start or 0
    values = values[start:]
    spaces = (False, True) if try_log else (False,)
    forms = [
        fit_form(shape, space, u[start:], values, index)
        for index, u in enumerate(axes)
        for space in spaces
        for shape in SHAPES
        if np.ptp(u[start:]) > 0 and (shape != "power" or u[start] > 0)
    ]

    def deciding(shape: str) -> Fit:
        return next(f for f in forms if (f.shape, f.log, f.axis) == (shape, log, axis))

    line, bend = deciding("line"), deciding("quadratic")
    best = min(form.aic for form in forms)
    plausible = [f for f in forms if math.exp((best - f.aic) / 2) >= PLAUSIBLE]
    others = [f for f in plausible if f is not line]
    return Trend(line, n, start, p, forms=(line, *others), bend=bend)
