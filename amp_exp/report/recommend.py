"""The recommendation: for each model and setting, the precision to use on this device, from the
verdicts (report/evidence.py) and the speeds, and why.

The rule (README "How to decide"):
- the fastest precision whose verdict is ``better``, ``matches`` or ``not_worse`` and that never
  failed a seed, where an interval shows it faster than fp32: the speed trial's, or for runs no
  trial timed, the interval of the paired per-seed throughput ratios (never a median);
- fp32 on this device when no interval shows a lower precision faster, or the faster ones are
  worse or unstable;
- not decided yet, with what would decide it, while the verdict of a faster one is open, or
  while fp32 itself did not learn on a seed (report/compare.py).

When two qualify, they are compared on speed, then loss scaling, skipped steps and memory, and
the reason says why one wins. The verdicts are report/decision.py's: this reads their names,
so the recommendation and the verdict lines always say the same.
"""

from __future__ import annotations

from typing import Any

from amp_exp.report.compare import BASELINE, FIX, Row, cell_key, group_cells, setting_key, subject
from amp_exp.report.decision import established, trial_interval
from amp_exp.report.words import CONTINUE, VERDICT_WORDS, ci_span, md_text

# How a run ends when it was stopped from outside (a signal, a kill): its sweep can go on.
INTERRUPTED = ("killed", "stopped")
RESUME = (
    "the sweep was interrupted before every run completed, so this rests on the runs that did: "
    "resume it with the same command, its hydra.sweep.dir and resume=auto"
)
QUALIFYING = ("better", "matches", "not_worse")
# Verdicts more data could still change: a faster precision with one of them leaves it open.
OPEN = ("inconclusive", "single_seed", "incomplete", None)
GPU_LINE = (
    "On a GPU the speeds change (bf16 and fp16 run on tensor cores, often 2-3x fp32, fp16 with "
    "loss scaling): `python -m amp_exp.predict` with these runs' overrides estimates each "
    "precision's step time on a chosen GPU."
)


def speed(comparison: dict[str, Any]) -> tuple[float | None, bool]:
    """(its speed against fp32's, whether an interval shows it faster): the speed trial's, and a
    trial whose rounds trend (the machine's speed drifted under it) shows nothing; else the
    interval of the paired per-seed throughput ratios. No interval (one seed), no claim."""
    found = comparison.get("speedup") or comparison.get("job_speedup")
    if found is None:
        return None, False
    return found["ratio"], established(found) == "faster"


def shown_speed(comparison: dict[str, Any]) -> str:
    """Its speed, with the interval that establishes it and where that interval comes from."""
    ratio, _ = speed(comparison)
    if ratio is None:
        return "speed not measured"
    trial, jobs = comparison.get("speedup"), comparison.get("job_speedup")
    if trial is not None:
        trend = "; its rounds trend" if (trial.get("trend") or {}).get("flag") else ""
        where = f"speed trial, {ci_span(trial)}{trend}"
    elif jobs["ci"] is not None:
        where = f"{jobs['source']}, {ci_span(jobs)}"
    else:
        where = "one seed's throughput, no interval"
    return f"{ratio:.2f}x {BASELINE}'s speed ({where})"


def costs(comparison: dict[str, Any], rows: list[Row]) -> dict[str, Any]:
    """What a precision costs beside its speed, over its runs: loss scaling, skipped steps and
    the saved activations against fp32's."""
    mine = [row for row in rows if cell_key(row) == cell_key(comparison)]
    ratios = [row["activation_ratio"] for row in mine if row["activation_ratio"] is not None]
    return {
        "loss_scaling": any(row["loss_scale"] is not None for row in mine),
        "skipped_steps": sum(row["skipped_steps"] or 0 for row in mine),
        "activation_ratio": min(ratios) if ratios else None,
    }


def overlap(first: dict[str, Any], second: dict[str, Any]) -> bool:
    """Whether two precisions' speeds are not told apart: their trial intervals overlap."""
    a, b = first.get("speedup"), second.get("speedup")
    if a is None or b is None:
        return False
    (a_low, a_high, _), (b_low, b_high, _) = trial_interval(a), trial_interval(b)
    return a_low <= b_high and b_low <= a_high


def cost_key(found: dict[str, Any]) -> tuple[bool, int, float]:
    """Fewer costs first: no loss scaling, fewer skipped steps, fewer saved activations."""
    return found["loss_scaling"], found["skipped_steps"], found["activation_ratio"] or 1.0


def why_wins(winner: dict[str, Any], other: dict[str, Any], tied: bool) -> str:
    """Why ``winner`` is chosen over ``other``, both qualifying."""
    w, o = winner["costs"], other["costs"]
    against = f"{shown_speed(winner)} against {shown_speed(other)}"
    reason = f"as fast ({against}, intervals overlap)" if tied else f"faster ({against})"
    differences = []
    if o["loss_scaling"] and not w["loss_scaling"]:
        differences.append(f"{other['label']} needs loss scaling")
    if o["skipped_steps"] > w["skipped_steps"]:
        differences.append(f"{other['label']} skipped {o['skipped_steps']} steps")
    if (w["activation_ratio"] or 1.0) < (o["activation_ratio"] or 1.0):
        differences.append(
            f"{winner['label']} saves {w['activation_ratio']:.2f}x fp32's activations against "
            f"{o['activation_ratio']:.2f}x"
            if o["activation_ratio"] is not None
            else f"{winner['label']} saves fewer activations"
        )
    return f"{other['label']} qualifies too; {winner['label']} is {reason}" + (
        f", and {', '.join(differences)}" if differences else ""
    )


def to_decide(comparison: dict[str, Any]) -> str:
    """What would decide an open verdict."""
    label, verdict = comparison["label"], comparison["verdict"]
    if comparison.get("baseline_not_learned"):
        return f"{label}: {BASELINE} did not learn on some seeds; {FIX}"
    if verdict == "single_seed":
        return f"{label}: one seed measures no noise; sweep seed=0,1,2"
    if verdict == "incomplete":
        return f"{label}: a seed was killed or stopped before it completed"
    if verdict is None:
        return f"{label}: no {comparison.get('metric') or 'eval metric'} to compare"
    needed = comparison.get("seeds_to_settle")
    more = f"about {needed} seeds would settle it" if needed else "many more seeds are needed"
    return f"{label}: inconclusive, {more}; {CONTINUE}"


def evidence(comparison: dict[str, Any]) -> dict[str, Any]:
    ratio, faster = speed(comparison)
    return {
        "precision": comparison["label"],
        "verdict": comparison["verdict"],
        "speedup": ratio,
        "faster": faster,
        "failed_seeds": len(comparison["failed_seeds"]),
        **comparison["costs"],
    }


def recommend_group(found: list[dict[str, Any]]) -> tuple[str | None, str]:
    """(the precision, why) for one model and setting's comparisons, each with its costs."""
    if not found:
        return BASELINE, f"only {BASELINE} ran; sweep precision=fp32,bf16,fp16 to compare"
    # Where fp32 itself did not learn, a verdict measures optimization luck: no answer yet.
    luck = [c for c in found if c.get("baseline_not_learned")]
    if luck:
        return None, "; ".join(to_decide(c) for c in luck)
    faster = [c for c in found if speed(c)[1]]
    qualified = [c for c in faster if c["verdict"] in QUALIFYING and not c["failed_seeds"]]
    if qualified:
        ranked = sorted(qualified, key=lambda c: -(speed(c)[0] or 0.0))
        winner = ranked[0]
        if len(ranked) > 1 and overlap(ranked[0], ranked[1]):
            winner = min(ranked[:2], key=lambda c: cost_key(c["costs"]))
        reason = f"{winner['label']} {VERDICT_WORDS[winner['verdict']]} at {shown_speed(winner)}"
        others = [c for c in ranked if c is not winner]
        if others:
            reason += f"; {why_wins(winner, others[0], overlap(winner, others[0]))}"
        return winner["label"], reason
    # A precision whose speed is unknown may still be the faster one: its verdict stays open.
    unknown = [c for c in found if speed(c)[0] is None]
    undecided = [c for c in [*faster, *unknown] if c["verdict"] in OPEN]
    if undecided:
        return None, "; ".join(to_decide(c) for c in undecided)
    if not faster:
        speeds = ", ".join(f"{c['label']} {shown_speed(c)}" for c in found)
        return BASELINE, f"no interval shows a lower precision faster ({speeds})"
    judged = ", ".join(
        f"{c['label']} is {c['verdict']}" + (" (a seed failed)" if c["failed_seeds"] else "")
        for c in faster
    )
    return BASELINE, f"the faster precisions do not qualify ({judged})"


def recommendations(rows: list[Row], comparisons: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One per model and setting: ``precision`` (None while not decided), ``reason`` and the
    ``evidence`` of each precision compared."""
    found = []
    compared = group_cells(comparisons, setting_key)
    for (model, setting), ended in group_cells(rows, setting_key).items():
        group = [{**c, "costs": costs(c, rows)} for c in compared.get((model, setting), [])]
        precision, reason = recommend_group(group)
        if any(row["status"] in INTERRUPTED for row in ended):
            reason += f"; {RESUME}"
        found.append(
            {
                "model": model,
                "setting": setting,
                "precision": precision,
                "reason": reason,
                "evidence": [evidence(c) for c in group],
            }
        )
    return found


def recommendation_lines(found: list[dict[str, Any]]) -> list[str]:
    """The report's opening: a line per model and setting, then what a GPU would change."""
    lines = []
    for item in found:
        if item["precision"] is None:
            use = "not decided yet"
        elif item["precision"] == BASELINE:
            use = f"{BASELINE} on this device"
        else:
            use = f"use {md_text(item['precision'])}"
        named = md_text(subject(item["model"], item["setting"]))
        lines.append(f"- **{named}: {use}.** {md_text(item['reason'])}.")
    return [*lines, "", GPU_LINE] if lines else []
