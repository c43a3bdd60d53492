"""Whether a run learned: the test that keeps a verdict from measuring optimization luck.

A precision is judged by its seed-s run against fp32's seed-s run. When fp32 never left its
starting plateau on a seed, that seed's difference says how lucky each optimization was, not
what the precision did, and more seeds only average such luck. So each run is named as learned
or not, and a comparison whose fp32 run did not learn says so and what would fix the run.

The rule (README "How to decide"): a run learned when its eval loss (its training loss where no
eval loss was measured) is at most ``DROP`` times its initial loss (the first training loss it
logged) and, where the data knows its best reachable loss (``loss_floor``, the synthetic tokens'
entropy), at most ``FLOOR_FACTOR`` times that floor.
"""

from __future__ import annotations

import math
from typing import Any

Row = dict[str, Any]

# "Fell well below its initial loss": by at least a fifth.
DROP = 0.8
# "Came within a factor of the floor": a run still 1.5x above the best reachable loss has not
# found the data's structure (a plateau at 3.6 against a floor of 1.05; AdamW reaches 1.13).
FLOOR_FACTOR = 1.5
# What a comparison whose fp32 run did not learn suggests: a fix of the training, never seeds.
FIX = "lower optimizer.lr, use optimizer=adamw, or raise trainer.max_steps"


def initial_loss(metrics: list[dict[str, Any]]) -> float | None:
    """The first training loss the run logged (metrics.jsonl)."""
    for row in metrics:
        if row.get("kind", "train") == "train" and isinstance(row.get("loss"), float):
            return row["loss"]
    return None


def learned(row: Row, metrics: list[dict[str, Any]]) -> tuple[bool | None, str]:
    """(learned, why) for one run: None where it did not complete or logged no loss to judge."""
    if row["status"] != "completed":
        return None, "did not complete"
    name, loss = "eval loss", row["eval"].get("eval_loss")
    if loss is None:
        name, loss = "final training loss", row["final_loss"]
    start, floor = initial_loss(metrics), row.get("loss_floor")
    if loss is None or start is None or not math.isfinite(loss):
        return None, "no finite loss to judge"
    shown = f"{name} {loss:.4g} from {start:.4g} at first log"
    if loss > DROP * start:
        return False, f"{shown}: it fell by less than {1 - DROP:.0%}"
    if floor is not None and floor > 0 and loss > FLOOR_FACTOR * floor:
        return False, f"{shown}, {loss / floor:.2f}x its loss_floor {floor:.4g}"
    if floor is not None and floor > 0:
        return True, f"{shown}, {loss / floor:.2f}x its loss_floor {floor:.4g}"
    return True, shown


def mark_learned(rows: list[Row], metrics: dict[str, list[dict[str, Any]]]) -> None:
    """Set each row's ``learned`` and ``learned_reason``; ``metrics`` by the row's ``run``."""
    for row in rows:
        row["learned"], row["learned_reason"] = learned(row, metrics.get(row["run"], []))


def unlearned_baselines(comparison: dict[str, Any], rows: list[Row]) -> list[Row]:
    """The fp32 runs, paired with this comparison's seeds, that did not learn."""
    by_run = {row["run"]: row for row in rows}
    paired = [
        row
        for row in rows
        if (row["model"], row["setting"], row["label"])
        == (comparison["model"], comparison["setting"], comparison["label"])
        and row["baseline"] in by_run
    ]
    return [
        by_run[row["baseline"]] for row in paired if by_run[row["baseline"]]["learned"] is False
    ]


def mark_comparisons(comparisons: list[dict[str, Any]], rows: list[Row]) -> None:
    """Set each comparison's ``baseline_not_learned``: the seeds whose fp32 run did not learn."""
    for found in comparisons:
        found["baseline_not_learned"] = [row["seed"] for row in unlearned_baselines(found, rows)]
