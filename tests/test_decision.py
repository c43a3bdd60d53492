"""One decision: every verdict comes from report/decision.py, and the recommendation reads it.

The code itself is inspected (no other module decides or rewrites a verdict); then planted
sweeps check what the decision makes of them: a better and faster precision is recommended, a
speedup is established by an interval (the trial's, else the paired per-seed throughput
ratios'), never by a median, and the recommendation's words and the verdict lines agree."""

from __future__ import annotations

import ast
from pathlib import Path

from amp_exp.report.assemble import build_report
from amp_exp.report.recommend import QUALIFYING
from test_evidence import write_lm_cell, write_trial
from test_report import write_run

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(ROOT / "amp_exp").rglob("*.py"), *(ROOT / "hydra_plugins").rglob("*.py")])
# The decision, and the one place its result is stored into a comparison.
DECIDES = "amp_exp/report/decision.py"
STORES = "amp_exp/report/evidence.py"


def verdict_key(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == "verdict"


def copies_a_verdict(value: ast.AST) -> bool:
    """A value read from a verdict another module decided: x["verdict"] or x.verdict (or None
    where there is none); or the kind a reader checks a recorded verdict against (``str``)."""
    if isinstance(value, ast.Name):
        return value.id == "str"
    if isinstance(value, ast.IfExp):
        return all(copies_a_verdict(v) for v in (value.body, value.orelse))
    if isinstance(value, ast.Constant):
        return value.value is None
    if isinstance(value, ast.Subscript):
        return verdict_key(value.slice)
    return isinstance(value, ast.Attribute) and value.attr == "verdict"


def verdict_writes(tree: ast.AST) -> list[int]:
    """The lines that store something other than a copy under a comparison's "verdict" key."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Subscript) and verdict_key(target.slice):
                    found.append(node.lineno)
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if key is not None and verdict_key(key) and not copies_a_verdict(value):
                    found.append(node.lineno)
    return found


def test_no_module_but_the_decision_decides_a_verdict_and_evidence_stores_it_once() -> None:
    """A second place that recomputes a verdict (a Holm pass rewriting it, a seed override, a
    rule re-implemented in the sweeper) would store into "verdict" or call the interval rule."""
    writers, rule_callers = {}, set()
    for path in SOURCES:
        name = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if lines := verdict_writes(tree):
            writers[name] = lines
        for node in ast.walk(tree):
            called = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            if called and node.func.attr == "decide" and name != DECIDES:
                rule_callers.add(name)
    assert list(writers) == [STORES] and len(writers[STORES]) == 1, writers
    # stats.decide (the interval rule's codes) runs in decision.py, and in stats.simulate only
    # for simulations; the decision itself is called from evidence.py alone.
    assert rule_callers <= {STORES, "amp_exp/report/stats.py"}, rule_callers


def test_a_better_and_faster_precision_is_recommended() -> None:
    """The review's sweep: bf16 5.4 points better than fp32 and 2.8x faster got "fp32 on this
    device ... the faster precisions do not qualify (bf16 is better)"."""
    assert "better" in QUALIFYING


def write_accuracy_cell(root: Path, precision: str, accuracies: list[float], first: int, speed):
    for seed, (accuracy, samples) in enumerate(zip(accuracies, speed, strict=True)):
        write_run(root / str(first + seed), "tiny_cnn", precision, samples, accuracy, seed=seed)


def test_better_by_five_points_and_faster_by_an_interval_is_used(tmp_path: Path) -> None:
    fp32 = [0.80, 0.81, 0.79, 0.80]
    write_accuracy_cell(tmp_path, "fp32", fp32, 0, [1000.0, 1010.0, 990.0, 1000.0])
    bf16 = [a + d for a, d in zip(fp32, [0.054, 0.050, 0.058, 0.054], strict=True)]
    write_accuracy_cell(tmp_path, "bf16", bf16, 4, [2800.0, 2850.0, 2750.0, 2790.0])
    report = build_report([tmp_path], tmp_path)
    (comparison,) = report["comparisons"]
    assert comparison["verdict"] == "better"
    (recommendation,) = report["recommendations"]
    assert recommendation["precision"] == "bf16", recommendation["reason"]
    assert recommendation["reason"].startswith("bf16 is better than fp32 at 2.")
    # No trial timed these runs: the interval is the paired per-seed ratios', labelled so.
    assert "paired per-seed throughput ratios, 95% CI 2." in recommendation["reason"]
    text = (tmp_path / "report.md").read_text()
    assert "- **tiny_cnn: use bf16.**" in text


def test_a_speedup_is_never_established_by_one_seed_or_a_median(tmp_path: Path) -> None:
    """Two seeds 1.5x and 0.9x faster: a median or mean of 1.2 would say faster, their interval
    reaches below 1, so nothing is claimed and the verdict, matches, stands."""
    fp32 = [0.80, 0.81]
    write_accuracy_cell(tmp_path, "fp32", fp32, 0, [1000.0, 1000.0])
    write_accuracy_cell(tmp_path, "bf16", [a + 0.0005 for a in fp32], 2, [1500.0, 900.0])
    report = build_report([tmp_path], tmp_path, tolerance=1.0)
    (comparison,) = report["comparisons"]
    low, high = comparison["job_speedup"]["ci"]
    assert low < 1 < high
    (recommendation,) = report["recommendations"]
    assert recommendation["precision"] == "fp32"
    assert recommendation["reason"].startswith("no interval shows a lower precision faster")


def test_a_trending_trial_blocks_a_faster_claim(tmp_path: Path) -> None:
    """A trial whose rounds drift measured the machine, not the precision: no faster claim."""
    write_lm_cell(tmp_path, "fp32", [1.10, 1.12, 1.11], 0)
    write_lm_cell(tmp_path, "bf16", [1.1001, 1.1199, 1.1102], 3)
    write_trial(tmp_path, bf16=(1.30, 1.20, 1.40))
    assert build_report([tmp_path], tmp_path)["recommendations"][0]["precision"] == "bf16"
    speed = tmp_path / "speed.json"
    trending = '"rounds": 10, "trend": {"flag": true}'
    speed.write_text(speed.read_text().replace('"rounds": 10', trending))
    (recommendation,) = build_report([tmp_path], tmp_path)["recommendations"]
    assert recommendation["precision"] == "fp32"
    assert "its rounds trend" in recommendation["reason"]


def test_the_recommendation_and_the_verdict_lines_state_the_same_verdicts(tmp_path: Path) -> None:
    write_lm_cell(tmp_path, "fp32", [1.10, 1.12, 1.11], 0)
    write_lm_cell(tmp_path, "bf16", [1.1001, 1.1199, 1.1102], 3)
    write_lm_cell(tmp_path, "fp16", [1.105, 1.128, 1.112], 6)
    write_trial(tmp_path, bf16=(1.30, 1.20, 1.40), fp16=(1.30, 1.20, 1.40))
    report = build_report([tmp_path], tmp_path)
    (recommendation,) = report["recommendations"]
    stated = {item["precision"]: item["verdict"] for item in recommendation["evidence"]}
    assert stated == {c["label"]: c["verdict"] for c in report["comparisons"]}
    words = {"matches": "matches fp32", "inconclusive": "against fp32 is inconclusive"}
    for label, verdict in stated.items():
        said = f"gpt_tiny: {label} {words[verdict]}"
        assert any(line.startswith(said) for line in report["verdicts"])
