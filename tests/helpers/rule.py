"""The interval rule's verdict of one paired difference, through report/decision.py (the one
place a verdict is decided), for tests that check the rule on planted differences."""

from __future__ import annotations

from amp_exp.report import decision, stats


def rule_verdict(
    difference: stats.PairedDifference, tolerance: float, higher_is_better: bool
) -> stats.Verdict | None:
    evidence = decision.Evidence(difference, (), tolerance, higher_is_better, None)
    return decision.interval_rule(evidence)
