"""One signal's trend: a straight line in log space (log-linear growth) fitted by least squares
after a changepoint test, its forecast with a prediction interval, and the point where it meets
a limit with a confidence interval (Fieller's).

- **Changepoint.** A run's signals often move fast early (warm-up, the first steps of a loss
  scale) and settle into a slower trend; extrapolating the whole run would carry the early
  slope forward. Every break that leaves ``MIN_POINTS`` on both sides is tested with a Chow
  F-test (two lines against one); the smallest p-value, Bonferroni-corrected over the breaks
  tried, below ``CHANGEPOINT_ALPHA`` keeps only the points after it.
- **Autocorrelation.** Training signals are not independent from one log step to the next. The
  residuals' lag-1 autocorrelation rho (0 or more) widens every interval by sqrt((1+rho)/(1-rho))
  and cuts the degrees of freedom to the effective sample size, the AR(1) correction.
- **Crossing.** Where the trend ``a + b x`` meets the limit ``L``: the set of x where L lies
  inside the trend's pointwise confidence band. At the true crossing ``(a + b x - L) / se`` is
  t-distributed, so the set covers it at the stated level (Fieller 1954). The set is a bounded
  interval only when the slope is significantly non-zero; otherwise no crossing is claimed.
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


@functools.lru_cache(maxsize=4096)
def _t_quantile(q: float, dof: float) -> float:
    # scipy's quantile costs tens of microseconds; a forecast asks for a few, many times over.
    return float(scipy.stats.t.ppf(q, dof))


CHANGEPOINT_ALPHA = 0.01
MAX_AUTOCORRELATION = 0.9


@dataclass(frozen=True)
class Line:
    """A least-squares line through (x, y) with what its intervals need."""

    intercept: float
    slope: float
    x_mean: float
    sxx: float
    n: int
    # The residual variance, times the AR(1) inflation.
    variance: float
    dof: float
    autocorrelation: float
    residual_sd: float

    def at(self, x: float | np.ndarray) -> float | np.ndarray:
        return self.intercept + self.slope * np.asarray(x, dtype=float)

    def _spread(self, x: float, extra: float) -> float:
        return math.sqrt(self.variance * (extra + 1 / self.n + (x - self.x_mean) ** 2 / self.sxx))

    def t(self, level: float) -> float:
        return _t_quantile(0.5 + level / 2, self.dof)

    def prediction(self, x: float, level: float) -> tuple[float, float, float]:
        """The trend at ``x`` and the interval a new observation there falls in."""
        centre = float(self.at(x))
        half = self.t(level) * self._spread(x, 1.0)
        return centre, centre - half, centre + half

    def confidence(self, x: float, level: float) -> tuple[float, float]:
        """The interval the trend itself at ``x`` lies in."""
        centre = float(self.at(x))
        half = self.t(level) * self._spread(x, 0.0)
        return centre - half, centre + half

    def slope_p(self, towards: float) -> float:
        """One-sided p-value that the slope is 0 against it moving ``towards`` (+1 or -1)."""
        se = math.sqrt(self.variance / self.sxx)
        if se == 0:
            return 0.0 if self.slope * towards > 0 else 1.0
        return float(scipy.stats.t.sf(towards * self.slope / se, self.dof))

    def crossing(self, limit: float, level: float) -> tuple[float, float, float] | None:
        """Where the trend meets ``limit`` and Fieller's interval of it, or None where the
        interval is unbounded (a slope not significantly different from zero at ``level``)."""
        if self.slope == 0:
            return None
        g = self.t(level) ** 2 * self.variance
        d = float(self.at(self.x_mean)) - limit
        # (d + b u)^2 <= g (1/n + u^2/Sxx), u = x - x_mean: a quadratic in u.
        a = self.slope**2 - g / self.sxx
        b = 2 * d * self.slope
        c = d**2 - g / self.n
        discriminant = b * b - 4 * a * c
        if a <= 0 or discriminant < 0:
            return None
        root = math.sqrt(discriminant)
        low, high = sorted(((-b - root) / (2 * a), (-b + root) / (2 * a)))
        estimate = self.x_mean - d / self.slope
        return estimate, self.x_mean + low, self.x_mean + high


def least_squares(x: np.ndarray, y: np.ndarray) -> Line:
    n = len(x)
    result = scipy.stats.linregress(x, y)
    residuals = y - (result.intercept + result.slope * x)
    rss = float(residuals @ residuals)
    rho = 0.0
    if n > 2 and rss > 0:
        rho = float(residuals[1:] @ residuals[:-1]) / rss
    rho = min(max(rho, 0.0), MAX_AUTOCORRELATION)
    inflation = (1 + rho) / (1 - rho)
    dof = max(n / inflation - 2, 1.0)
    return Line(
        intercept=float(result.intercept),
        slope=float(result.slope),
        x_mean=float(x.mean()),
        sxx=float(((x - x.mean()) ** 2).sum()),
        n=n,
        variance=rss / max(n - 2, 1) * inflation,
        dof=dof,
        autocorrelation=rho,
        residual_sd=math.sqrt(rss / max(n - 2, 1)),
    )


def rss(x: np.ndarray, y: np.ndarray) -> float:
    """The residual sum of squares of the least-squares line (closed form: many are needed)."""
    dx, dy = x - x.mean(), y - y.mean()
    sxx = dx @ dx
    return float(dy @ dy - (dx @ dy) ** 2 / sxx) if sxx > 0 else float(dy @ dy)


def changepoint(x: np.ndarray, y: np.ndarray) -> tuple[int | None, float | None]:
    """The index the later regime starts at, or None, and the Bonferroni-corrected p-value of
    the best break (None where the series is too short to try one)."""
    n = len(x)
    breaks = range(MIN_POINTS, n - MIN_POINTS + 1)
    if not breaks or n <= 4:
        return None, None
    whole = rss(x, y)
    best, best_p = None, 1.0
    for k in breaks:
        split = rss(x[:k], y[:k]) + rss(x[k:], y[k:])
        if split <= 0:
            p = 0.0 if whole > 0 else 1.0
        else:
            f = ((whole - split) / 2) / (split / (n - 4))
            p = float(scipy.stats.f.sf(f, 2, n - 4))
        if p < best_p:
            best, best_p = k, p
    corrected = min(1.0, best_p * len(breaks))
    return (best if corrected < CHANGEPOINT_ALPHA else None), corrected


@dataclass(frozen=True)
class Trend:
    """A signal's fitted trend, or why it has none."""

    line: Line | None
    # The number of usable points, and the index of the first one the line is fitted to.
    points: int
    start: int = 0
    changepoint_p: float | None = None
    unforecastable: str | None = None


def fit_trend(x: np.ndarray, y: np.ndarray) -> Trend:
    """The trend of ``y`` (already in the space it grows linearly in) over ``x``, fitted after
    the changepoint, if one is found; ``x`` and ``y`` hold only usable points."""
    n = len(x)
    if n < MIN_POINTS:
        return Trend(None, n, unforecastable=f"{n} usable log points, fewer than {MIN_POINTS}")
    if np.ptp(x) == 0:
        return Trend(None, n, unforecastable="every point is at the same place on the time axis")
    start, p = changepoint(x, y)
    start = start or 0
    return Trend(least_squares(x[start:], y[start:]), n, start, p)
