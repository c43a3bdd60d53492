"""The one decision: each comparison's verdict against fp32, and whether a speedup is established,
decided here and nowhere else.

In: for each comparison of a report (a family), its paired differences (report/stats.py's
``PairedDifference``, the interval at the level of its look), the verdict its seeds force
(report/evidence.py's ``seed_account``: ``unstable``, ``incomplete``, ...), the one-sided level of
its look (2.5%, or an evidence sweep's per-look level, report/sequential.py) and the family rule
(``holm`` or ``none``). Out: one ``Decision`` per comparison. The report, the evidence sweeper, the
sensitivity repair and the recommendation all read ``Decision.verdict`` as report/evidence.py
stores it; none of them recomputes or rewrites it (tests/test_decision.py inspects the code).

The order, each step only ever withdrawing a claim:
1. a verdict on the seeds (a failed, killed or not-engaged seed) overrides the numbers;
2. the interval rule (report/stats.py) on the paired differences;
3. Holm's step-down across the family, a family per claim, each p-value read in units of its own
   look's level (so an evidence sweep's stricter looks weigh as they were paid for): a claim Holm
   does not keep becomes ``inconclusive``;
4. a ``matches`` whose differences are too skewed for the t interval to hold its rate
   (report/stats.py's ``t_reliable``) is withheld as ``inconclusive``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from amp_exp.config.schema import ReportConfig
from amp_exp.report import stats
from amp_exp.report.stats import Verdict

# Holm across a report's comparisons, unless report.familywise says none.
DEFAULT_FAMILYWISE = ReportConfig.familywise
# The claims the rule makes, each with the key of the p-value that makes it: Holm's families,
# and the p-value shown beside a verdict (never the test of no difference).
CLAIM_P = {
    Verdict.matches: "p_equivalence",
    Verdict.not_worse: "p_not_worse",
    Verdict.worse: "p_worse",
    Verdict.better: "p_better",
}
# Why a claim the interval rule made was withdrawn.
WITHHELD_FAMILY = "familywise"
WITHHELD_SHAPE = "shape"


@dataclass(frozen=True)
class Evidence:
    """What one comparison's verdict is decided from."""

    # None where no run measured the quality metric.
    difference: stats.PairedDifference | None
    deltas: tuple[float, ...]
    tolerance: float | None
    higher_is_better: bool
    # The verdict the seeds force (report/evidence.py's SEED_VERDICTS), or None.
    seed_verdict: Verdict | None
    # The one-sided level of each claim at this comparison's look.
    alpha: float = stats.ONE_SIDED


@dataclass(frozen=True)
class Decision:
    verdict: Verdict | None
    # The interval rule's verdict on the numbers alone (None without a quality metric).
    unadjusted: Verdict | None
    # Why a claim of the rule was withdrawn (``WITHHELD_*``), or None.
    withheld: str | None


def interval_rule(item: Evidence) -> Verdict | None:
    """The rule of report/stats.py on the comparison's interval."""
    if item.difference is None or item.tolerance is None:
        return None
    ci = item.difference.estimate.ci95
    if ci is None:
        return Verdict.single_seed
    code = stats.decide(np.array(ci[0]), np.array(ci[1]), item.tolerance, item.higher_is_better)
    return stats.RULE_VERDICTS[int(code)]


def p_value(item: Evidence, claim: Verdict) -> float | None:
    difference = item.difference
    return None if difference is None else getattr(difference, CLAIM_P[claim])


def kept_by_family(items: Sequence[Evidence], familywise: str) -> list[set[Verdict]]:
    """For each comparison, the claims Holm keeps at the family's level: a comparison's p-value
    is read as a multiple of its own look's level, so a fixed report is plain Holm at 2.5%.
    ``familywise`` is one of FAMILYWISE (config/values.py and the CLI's choices refuse others)."""
    kept: list[set[Verdict]] = [set(CLAIM_P) for _ in items]
    if familywise == "none":
        return kept
    # A comparison its seeds decided, or with no interval, makes no statistical claim.
    judged = [
        i
        for i, item in enumerate(items)
        if item.seed_verdict is None and p_value(item, Verdict.matches) is not None
    ]
    for claim in CLAIM_P:
        scaled = [p_value(items[i], claim) * stats.ONE_SIDED / items[i].alpha for i in judged]
        for index, rejected in zip(judged, stats.holm(scaled, stats.ONE_SIDED), strict=True):
            if not rejected:
                kept[index].discard(claim)
    return kept


def decide(items: Sequence[Evidence], familywise: str = DEFAULT_FAMILYWISE) -> list[Decision]:
    """The verdict of every comparison of one family (a report's), in the order of the module
    docstring."""
    decisions = []
    for item, kept in zip(items, kept_by_family(items, familywise), strict=True):
        unadjusted = interval_rule(item)
        if item.seed_verdict is not None:
            decisions.append(Decision(item.seed_verdict, unadjusted, None))
            continue
        verdict, withheld = unadjusted, None
        if verdict in CLAIM_P and verdict not in kept:
            verdict, withheld = Verdict.inconclusive, WITHHELD_FAMILY
        if verdict is Verdict.matches and not stats.t_reliable(item.deltas):
            verdict, withheld = Verdict.inconclusive, WITHHELD_SHAPE
        decisions.append(Decision(verdict, unadjusted, withheld))
    return decisions


def trial_interval(found: dict[str, Any]) -> tuple[float, float, float]:
    """A speedup's one interval and its level: a speed trial's at the level its looks were made
    at (capability/ratio.py), 95% in a speed.json written before the trial looked."""
    if "ci" in found:
        return (*found["ci"], found["confidence"])
    return (*found["ci95"], 0.95)


def established(found: dict[str, Any]) -> str | None:
    """What a speedup establishes against fp32: ``"faster"`` where its interval lies wholly
    above 1, ``"slower"`` wholly below, None where it reaches across 1, has no interval (one
    seed's jobs) or its rounds trend (the machine's speed drifted under the trial, which the
    interval assumes it did not). The one rule every "faster" claim rests on: the
    recommendation, the verdict lines, the doctor, ``precision=auto``. ``found`` is a speed
    trial's speedup, or for runs no trial timed report/evidence.py's ``job_speedup``."""
    if (found.get("trend") or {}).get("flag", False) or found.get("ci", ()) is None:
        return None
    low, high, _ = trial_interval(found)
    return "faster" if low > 1 else "slower" if high < 1 else None
