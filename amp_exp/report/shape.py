"""Whether the paired differences look normal enough for the t interval's ``matches`` to hold
its stated rate: a check of their sample skewness, calibrated by simulation.

The t rule's false ``matches`` is 2.5% for normal differences but 15-18% for strongly skewed ones
(docs/sweeps.md). At 2-5 seeds no permutation test can reach 2.5%, so where the differences are
visibly skewed (|G1|, the adjusted Fisher-Pearson skewness of scipy.stats.skew, beyond the
95th percentile it reaches for normal differences at their n, simulated:
scripts/calibrate_rules.py) a ``matches`` is withheld as ``inconclusive`` (report/decision.py)
rather than given at an unknown rate. By construction it withholds 5% of normal ``matches``;
skew the seeds do not show (no outlier drawn yet) it cannot see: the rates it leaves are in
docs/sweeps.md. Two differences have no skewness: below 3 the check passes them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy import stats

from amp_exp.report.calibration import calibration

# The fewest differences whose skewness is defined.
MIN_N = 3
# The share of normal differences the check flags, at every n (what the thresholds are for).
WITHHOLD_RATE = 0.05


def skewness(deltas: np.ndarray) -> np.ndarray:
    """|G1| along the last axis (many sweeps at once in simulation); 0 for no spread."""
    deltas = np.asarray(deltas, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        found = np.abs(stats.skew(deltas, axis=-1, bias=False))
    return np.nan_to_num(found, nan=0.0)


def threshold(n: int) -> float | None:
    """The simulated 95th percentile of |G1| for ``n`` normal differences (the largest n
    simulated stands for more); None below ``MIN_N``."""
    if n < MIN_N:
        return None
    found = calibration()["shape"]["thresholds"]
    return float(found.get(str(n), found[max(found, key=int)]))


def t_reliable(deltas: Sequence[float]) -> bool:
    """Whether the differences show no more skew than normal ones would 95% of the time."""
    limit = threshold(len(deltas))
    return limit is None or float(skewness(np.asarray(deltas))) <= limit
