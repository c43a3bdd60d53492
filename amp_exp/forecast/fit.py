"""One signal's trend: least-squares fits of a few growth forms over one or more time axes, after
a changepoint test, with their bands and where each meets a limit.

- **Forms.** In the signal's own space or in log space (growth by factors), each of: a line in
  the axis ``u``, a power law (a line in log ``u``) and a quadratic (a line whose slope drifts
  steadily: growth that speeds up or slows down); each over every candidate axis (forecast.py:
  the cumulative learning rate, and the step where the rate varies). Where there are two axes,
  also the **mixed** line over both at once (a + b·cumulative rate + c·step: a growth that is
  part per unit of rate and part per step, which is between the one-axis forms, not one of
  them). ``AIC`` compares them on the values, the log forms' likelihoods with their Jacobian, so
  forms fitted in different spaces or over different axes are comparable, and the mixed line
  pays for its third parameter.
- **Power of the rate.** Under Adam each weight moves by at most a small multiple of the learning
  rate a step (the update is the rate times m/sqrt(v), which is bounded; decoupled weight decay only
  shrinks), so a weight matrix grows at most linearly in the cumulative rate ``u``, and a block's
  output (a product of the matrices before it, on fixed data) at most as a polynomial in it; once it
  has grown well past its start, as a power of ``u``: log y linear in log u, not in u. A growth by a
  factor per unit of rate needs a feedback the bounded steps do not make (a planted one does, and
  the points tell the two forms apart). So for such signals (forecast.py) the power law of the
  cumulative rate, in log space, is a candidate to decide beside the lines; a log line through a
  power law's points bends down (slowing) over a long span, and over a short one, after a
  changepoint that is only its curvature, it extrapolates the local rate by factors: a false alarm
  (docs/forecast.md, the fp16 MLP).
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
- **Crossing.** What a limit is checked on is a logged value (the loss scale: its read at the
  log step), not the trend: the first read past the limit comes where the trend plus the reads'
  spread about it first passes, before the trend itself reaches it wherever the reads scatter.
  ``Fit.passage`` takes each future read as the trend plus t-distributed noise of the reads'
  spread about it (independent reads: the chance that none has passed is the product of each
  one's), and gives the step where the first passage is as likely as not (the trend at its
  centre), the earliest it may come (the trend at its confidence band's edge nearest the limit,
  and a chance of (1 - level) / 2) and the step by which it surely has (the far edge, (1 +
  level) / 2). With no spread this is where the trend, or its band's edge, reaches the limit:
  the band's set covers the true crossing at its level (Fieller 1954, here on a grid so that
  every form is treated alike).
- **Slowing.** A line carries its rate forward for good. Where the quadratic over the same
  points (after any changepoint) bends away from the limit, one-sided at the changepoint test's
  level, the growth is slowing more than noise would make it look, and the quadratic decides
  instead: a crossing is claimed only if it reaches the limit by the planned end. Healthy runs'
  attention logits grow fast early and level off (docs/forecast.md); the line through them
  crossed the limit, the quadratic does not. (Over the points of the regime the changepoint
  keeps only: a later regime that grows steadily after a fast start is extrapolated, as one real
  run that took off later showed it should be.)
- **Chance.** ``Fit.chance`` gives the chance that some read passes the limit by the planned
  end (normal reads about the trend; about one half where ``passage``'s centre, whose reads are
  a t's, is the end) and the interval the true chance lies in: the trend anywhere in its band
  and the reads' spread anywhere in its own chi-square interval, each at half the miss rate.
  The chance of a far tail turns on the spread more than on the trend; with the spread taken as
  known, such an interval covered the true chance a third of the time or less.
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
# The line over both axes, and the same with the step's square: how it is checked to hold and
# whether it slows (``likeliest_line``, ``Trend.decider``), as a one-axis line's quadratic does.
MIXED, MIXED_BEND = "mixed", "mixed quadratic"
# The power law with the square of log u: whether a power law holds its exponent or slows.
POWER_BEND = "power quadratic"


@functools.lru_cache(maxsize=4096)
def _t_quantile(q: float, dof: float) -> float:
    # scipy's quantile costs tens of microseconds; a forecast asks for a few, many times over.
    return float(scipy.stats.t.ppf(q, dof))


@dataclass(frozen=True)
class Fit:
    """A least-squares fit of one form with what its bands need. The design is in ``z``, each of
    its axes centred and scaled over the fitted points (the quadratic's columns stay
    comparable), or log ``u`` for the power law. Positions are given on every candidate axis
    (``us``, one array per axis); a form reads the ones in ``axes``."""

    shape: str
    log: bool
    coefficients: np.ndarray
    # The coefficients' covariance, times the AR(1) inflation.
    covariance: np.ndarray
    centre: tuple[float, ...]
    scale: tuple[float, ...]
    n: int
    dof: float
    autocorrelation: float
    residual_sd: float
    aic: float
    # Which of the candidate time axes the form is over (indices into the caller's list): one,
    # or both for the mixed line.
    axes: tuple[int, ...] = (0,)

    def design(self, us: list[np.ndarray]) -> np.ndarray:
        us = [np.atleast_1d(np.asarray(us[a], dtype=float)) for a in self.axes]
        if self.shape.startswith("power"):
            z = np.log(us[0])
            square = [z * z] if self.shape == POWER_BEND else []
            return np.column_stack([np.ones_like(z), z, *square])
        zs = [(u - c) / s for u, c, s in zip(us, self.centre, self.scale, strict=True)]
        # A quadratic's square is of its last axis: the step, for the mixed line's.
        square = [zs[-1] * zs[-1]] if self.shape.endswith("quadratic") else []
        return np.column_stack([np.ones_like(zs[0]), *zs, *square])

    @property
    def slopes(self) -> tuple[float, ...]:
        """The trend's slope per unit of each of its axes at the centre of the fitted points (per
        unit of log ``u`` for the power law)."""
        if self.shape.startswith("power"):
            return (float(self.coefficients[1]),)
        return tuple(float(self.coefficients[1 + i]) / s for i, s in enumerate(self.scale))

    @property
    def intercept(self) -> float:
        """The trend at u = 0 on its axes (log u = 0 for the power law)."""
        origin = np.array([1.0 if self.shape.startswith("power") else 0.0])
        return float(self.at([origin] * (max(self.axes) + 1))[0])

    def at(self, us: list[np.ndarray]) -> np.ndarray:
        return self.design(us) @ self.coefficients

    def t(self, level: float) -> float:
        return _t_quantile(0.5 + level / 2, self.dof)

    def _trend_variance(self, us: list[np.ndarray]) -> np.ndarray:
        design = self.design(us)
        return np.einsum("ij,jk,ik->i", design, self.covariance, design)

    def confidence(self, us: list[np.ndarray], level: float) -> tuple[np.ndarray, np.ndarray]:
        """The band the trend itself at each point (``us``) lies in."""
        centre, half = self.at(us), self.t(level) * np.sqrt(self._trend_variance(us))
        return centre - half, centre + half

    def prediction(
        self, us: list[np.ndarray], level: float
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The trend at each point (``us``) and the interval a new observation there falls in."""
        noise = self.residual_sd**2 * (1 + self.autocorrelation) / (1 - self.autocorrelation)
        centre = self.at(us)
        half = self.t(level) * np.sqrt(self._trend_variance(us) + noise)
        return centre, centre - half, centre + half

    def _contrast_p(self, contrast: np.ndarray, towards: float) -> float:
        """One-sided p-value that ``contrast`` times the coefficients is 0 against it having the
        sign of ``towards``."""
        estimate = float(contrast @ self.coefficients)
        se = math.sqrt(max(float(contrast @ self.covariance @ contrast), 0.0))
        if se == 0:
            return 0.0 if estimate * towards > 0 else 1.0
        return float(scipy.stats.t.sf(towards * estimate / se, self.dof))

    def rise_p(self, now: list[np.ndarray], end: list[np.ndarray], towards: float) -> float:
        """One-sided p-value that the trend does not change from ``now`` to ``end`` (a point
        each: its place on every axis) against it moving ``towards`` (+1 or -1). For a line, or a
        power law, whose axis only grows, the slope's own t-test; for the mixed line, the test
        of its rise along the planned run, whatever the mix of its two slopes."""
        design = self.design(end) - self.design(now)
        return self._contrast_p(design[0], towards)

    def bend_p(self, towards: float) -> float:
        """A quadratic's one-sided p-value that its curvature is 0 against the trend bending
        ``towards`` (+1: up, -1: down)."""
        contrast = np.zeros(len(self.coefficients))
        contrast[-1] = 1.0
        return self._contrast_p(contrast, towards)

    def read_spread(self, us: list[np.ndarray], reads: np.ndarray) -> tuple[float, float]:
        """The spread of the values a limit is checked on (``reads``, at the fitted points'
        places ``us``, in this form's space) about this form's trend, and its degrees of
        freedom: the reads' count less the coefficients, cut by their residuals' lag-1
        autocorrelation as the fit's are (``fit_form``)."""
        residuals = reads - self.at(us)
        k = len(self.coefficients)
        rss = float(residuals @ residuals)
        rho = float(residuals[1:] @ residuals[:-1]) / rss if len(reads) > 2 and rss > 0 else 0.0
        rho = min(max(rho, 0.0), MAX_AUTOCORRELATION)
        sd = math.sqrt(rss / max(len(reads) - k, 1))
        return sd, max(len(reads) * (1 - rho) / (1 + rho) - k, 1.0)

    def passage(
        self,
        us: list[np.ndarray],
        limit: float,
        direction: int,
        level: float,
        sd: float,
        reads: np.ndarray,
    ) -> tuple[int | None, int | None, int | None]:
        """Indices into the increasing grid (its places on every axis: ``us``; ``reads``, the
        number of log reads each grid point stands for, 0 where the run has already read): where
        the first read past ``limit`` is as likely as not to have come, with the trend at its
        centre; where it may have come (probability (1 - level) / 2), with the trend at its band's
        edge nearest the limit; and where it surely has (probability (1 + level) / 2), with the
        trend at the far edge. Each read is the trend plus t-distributed noise of spread ``sd``
        (independent reads: the chance of no read past the limit is the product over them).
        None where not within the grid."""
        low, high = self.confidence(us, level)
        near, far = (high, low) if direction > 0 else (low, high)
        tail = (1 - level) / 2
        found = []
        for trend, probability in ((self.at(us), 0.5), (near, tail), (far, 1 - tail)):
            if sd > 0:
                gap = direction * (trend - limit) / sd
                # log P(a read is not past the limit), per read, summed over the reads.
                clear = np.cumsum(reads * scipy.stats.t.logcdf(-gap, self.dof))
                reached = clear <= math.log1p(-probability)
            else:
                reached = (reads > 0) & (direction * trend >= direction * limit)
            found.append(int(np.argmax(reached)) if reached.any() else None)
        return tuple(found)

    def chance(
        self,
        us: list[np.ndarray],
        limit: float,
        direction: int,
        sds: tuple[float, float, float],
        reads: np.ndarray,
        level: float,
    ) -> tuple[float, float, float]:
        """The chance that a read passes ``limit`` by the grid's end (``us``: the grid's places
        on every axis; ``reads``: the number of log reads each grid point stands for; reads
        independent, as in ``passage``), and the interval the true chance lies in at ``level``
        or more. Each read is the trend plus normal noise: for the chance, the trend at its
        centre and the spread ``sds[0]``; for the interval, the trend anywhere in its band at
        ``(1 + level) / 2`` (its edge far from the limit for the least chance, near for the
        most) and the spread anywhere in its own interval at that level (``sds[1:]``), each part
        missing at most half the rest. The spread's uncertainty is the interval's, not the
        noise's: a t would count it twice, and with the few degrees of freedom of an
        autocorrelated signal its tails give a chance to a read 70 spreads from the trend."""
        ahead = reads > 0
        low, high = self.confidence(us, 1 - (1 - level) / 2)
        near, far = (high, low) if direction > 0 else (low, high)

        def by_end(trend: np.ndarray, sd: float) -> float:
            trend = trend[ahead]
            if sd <= 0:
                return float((direction * (trend - limit) >= 0).any())
            clear = scipy.stats.norm.logcdf(-direction * (trend - limit) / sd) @ reads[ahead]
            return max(0.0, -math.expm1(clear))

        return (
            by_end(self.at(us), sds[0]),
            min(by_end(far, sd) for sd in sds[1:]),
            max(by_end(near, sd) for sd in sds[1:]),
        )


def fit_form(
    shape: str, log: bool, us: list[np.ndarray], values: np.ndarray, axes: tuple[int, ...] = (0,)
) -> Fit:
    """The least-squares fit of ``values`` (positive where ``log``) in one form over the
    candidate axes ``axes`` (``us``: the points' places on every candidate axis)."""
    y = np.log(values) if log else values
    centre = tuple(float(us[a].mean()) for a in axes)
    scale = tuple(float(np.ptp(us[a]) / 2) or 1.0 for a in axes)
    probe = Fit(shape, log, np.zeros(0), np.zeros((0, 0)), centre, scale, 0, 1, 0, 0, 0, axes)
    design = probe.design(us)
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
        axes=axes,
    )


def rss(design: np.ndarray, y: np.ndarray) -> float:
    """The residual sum of squares of the least-squares fit of ``y`` on ``design``'s columns."""
    coefficients, _, _, _ = np.linalg.lstsq(design, y, rcond=None)
    residuals = y - design @ coefficients
    return float(residuals @ residuals)


def changepoint(
    design: np.ndarray, y: np.ndarray, axes: tuple[np.ndarray, ...] = ()
) -> tuple[int | None, float | None]:
    """The index the later regime starts at, or None, and the Bonferroni-corrected p-value of
    the best break (None where the series is too short to try one): a Chow F-test of the fit on
    ``design``'s columns (a line's: 1 and its axis) in two regimes against one. A break leaves a
    quarter of the span of every axis in ``axes`` on each side: the forms over each axis are
    fitted to the points after it."""
    n, k = design.shape

    def spans(index: int) -> bool:
        return all(
            min(u[index - 1] - u[0], u[-1] - u[index]) >= MIN_SPAN * (u[-1] - u[0]) for u in axes
        )

    breaks = [b for b in range(MIN_POINTS, n - MIN_POINTS + 1) if spans(b)]
    if not breaks or n <= 2 * k:
        return None, None
    whole = rss(design, y)
    split = np.array([rss(design[:b], y[:b]) + rss(design[b:], y[b:]) for b in breaks])
    # One call for every break: scipy's survival function costs more than the sums of squares.
    with np.errstate(divide="ignore", invalid="ignore"):
        p = scipy.stats.f.sf(((whole - split) / k) / (split / (n - 2 * k)), k, n - 2 * k)
    p = np.where(split > 0, p, 0.0 if whole > 0 else 1.0)
    best = int(np.argmin(p))
    corrected = min(1.0, float(p[best]) * len(breaks))
    return (breaks[best] if corrected < CHANGEPOINT_ALPHA else None), corrected


def line_forms(count: int) -> list[tuple[str, tuple[int, ...]]]:
    """The lines that may decide over ``count`` candidate axes: one over each axis, and the
    mixed line over both where there are two; each with the form that adds its last axis's
    square (its quadratic: whether it holds, whether it slows)."""
    lines = [("line", (axis,)) for axis in range(count)]
    return lines + ([(MIXED, (0, 1))] if count == 2 else [])


def bend_of(shape: str) -> str:
    """The deciding form with its last axis's square added (log u's for the power law)."""
    return {MIXED: MIXED_BEND, "power": POWER_BEND}.get(shape, "quadratic")


def likeliest_line(
    axes: list[np.ndarray], values: np.ndarray, spaces: tuple[bool, ...], powers: bool = False
) -> tuple[str, tuple[int, ...], bool]:
    """The shape, axes and space (log: growth by factors; ``spaces``, those allowed) of the line
    that is the likeliest model of all the points (the AIC's pick: the mixed line pays for its third
    parameter; a tie goes to log space and to the first axis); where ``powers``, the power law of
    the first axis in log space (a line in log u: growth by a power of the cumulative rate, not by
    a factor per unit of it) decides wherever it is plausible beside the likeliest line (its
    relative likelihood at least ``PLAUSIBLE``). Over all the points,
    each line alike: a changepoint found for one only would compare them on different spans. The
    first axis is the method's (forecast.py: the cumulative rate); a line with the step in it (over
    the step, or the mixed line) is an alternative that decides only where it holds over all the
    points: with the step's square added it bends neither way at the changepoint test's level. A
    growth per step whatever the rate goes on alike through warm-up, peak and decay; a rise that
    starts late in a decay to zero is no such growth. The mixed line decides only where its two
    parts go the same way (a growth, or a fall, both per unit of rate and per step): parts that pull
    against each other (a fall per unit of rate that a rise per step makes up) follow the schedule's
    shape, not a growth of either kind; the stretched plan would multiply the difference, and a rise
    late in a decay to zero is fitted so."""

    def holds(shape: str, along: tuple[int, ...], log: bool) -> bool:
        bend = fit_form(bend_of(shape), log, axes, values, along)
        if min(bend.bend_p(+1), bend.bend_p(-1)) < CHANGEPOINT_ALPHA / 2:
            return False
        return shape != MIXED or math.prod(fit_form(shape, log, axes, values, along).slopes) > 0

    candidates = [
        (shape, along, log)
        for shape, along in line_forms(len(axes))
        for log in spaces
        if along == (0,) or holds(shape, along, log)
    ]
    likeliest = min(candidates, key=lambda c: fit_form(c[0], c[2], axes, values, c[1]).aic)
    if not powers or axes[0][0] <= 0:
        return likeliest
    # The power law is what the bounded steps allow; growth by factors (the log line) needs a
    # feedback beside them, so it decides only where the points all but rule the power law out,
    # as the hull drops a form (PLAUSIBLE). Over a quarter the two are often alike, and the log
    # line carries the early fast change on: the fp16 drift's early alarms (docs/forecast.md).
    power = fit_form("power", True, axes, values, (0,)).aic
    best = fit_form(likeliest[0], likeliest[2], axes, values, likeliest[1]).aic
    return ("power", (0,), True) if math.exp((best - power) / 2) >= PLAUSIBLE else likeliest


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
    # The deciding line with its last axis's square added (its quadratic), in its space, over
    # the same points: whether the growth is slowing (``decider``).
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
    axes: list[np.ndarray],
    values: np.ndarray,
    log: bool,
    try_log: bool,
    shape: str = "line",
    along: tuple[int, ...] = (0,),
) -> Trend:
    """The trend of ``values`` (only usable points) over the candidate time ``axes`` (each the
    points' places on one axis), fitted after the changepoint found for the deciding line: in log
    space where ``log``, the ``shape`` (a line, the mixed line, or the power law) over
    ``axes[along]``; ``try_log``: the log forms are candidates too (the values are positive and may
    grow by factors). Every form is fitted over the same points, after that changepoint, on every
    axis."""
    n = len(values)
    if n < MIN_POINTS:
        return Trend(None, n, unforecastable=f"{n} usable log points, fewer than {MIN_POINTS}")
    if any(np.ptp(axes[a]) == 0 for a in along):
        return Trend(None, n, unforecastable="every point is at the same place on the time axis")
    whole = fit_form(shape, log, axes, values, along)
    start, p = changepoint(whole.design(axes), np.log(values) if log else values, tuple(axes))
    start = start or 0
    values, axes = values[start:], [u[start:] for u in axes]
    spaces = (False, True) if try_log else (False,)
    usable = [i for i, u in enumerate(axes) if np.ptp(u) > 0]
    shapes = [(form, (i,)) for i in usable for form in SHAPES if form != "power" or axes[i][0] > 0]
    shapes += [(MIXED, (0, 1))] if usable == [0, 1] else []
    forms = [fit_form(form, space, axes, values, on) for form, on in shapes for space in spaces]
    line = next(f for f in forms if (f.shape, f.log, f.axes) == (shape, log, along))
    bend = fit_form(bend_of(shape), log, axes, values, along)
    best = min(form.aic for form in forms)
    plausible = [f for f in forms if math.exp((best - f.aic) / 2) >= PLAUSIBLE]
    others = [f for f in plausible if f is not line]
    return Trend(line, n, start, p, forms=(line, *others), bend=bend)
