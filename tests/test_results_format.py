"""The results format is written down: the engine's own files conform to the shipped schemas, the
schema names every summary field, and a summary of another version is refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from amp_exp.config.values import validate
from amp_exp.errors import ConfigError
from amp_exp.results.format import (
    FORMAT_VERSION,
    SUMMARY_SCHEMA,
    VERSION_KEY,
    OtherFormatVersion,
    problems,
    run_problems,
    schema,
    validate_run,
)
from amp_exp.results.summary import FIELDS
from amp_exp.run import train
from helpers.runs import FAST, composed
from helpers.warm_python import python_m


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory) -> Path:
    """A completed bf16 run of the engine (4 steps, evaluated): its summary.json and
    metrics.jsonl with train and eval rows."""
    run_dir = tmp_path_factory.mktemp("engine_run")
    train(validate(composed((*FAST, "precision=bf16"))), run_dir)
    return run_dir


@pytest.fixture
def engine_copy(engine_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(engine_run, copy)
    return copy


def rewrite_summary(run_dir: Path, **changes) -> None:
    path = run_dir / "summary.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_the_engines_summary_and_metrics_conform_to_the_shipped_schemas(engine_run) -> None:
    kinds = {json.loads(line)["kind"] for line in (engine_run / "metrics.jsonl").open()}
    assert {"train", "eval"} <= kinds
    assert run_problems(engine_run) == []
    assert json.loads((engine_run / "summary.json").read_text())[VERSION_KEY] == FORMAT_VERSION


def test_the_schema_requires_every_field_it_types_and_a_run_writes_exactly_those(
    engine_run,
) -> None:
    """A property the schema types but does not require (or the reverse) fails here, and so does
    a summary.json without a field the schema requires or with a key that is neither one of them
    nor an eval metric its task_metrics declare (FIELDS is the schema's required list, so the run
    is checked against the shipped file itself)."""
    shipped = schema(SUMMARY_SCHEMA)
    assert list(shipped["properties"]) == shipped["required"]
    written = json.loads((engine_run / "summary.json").read_text())
    declared = {metric["name"] for metric in written["task_metrics"]["metrics"]}
    assert set(FIELDS) <= set(written)
    assert set(written) - set(FIELDS) == declared


def test_a_field_of_the_wrong_kind_is_named(engine_copy) -> None:
    rewrite_summary(engine_copy, skipped_steps="none", precision_audit={"engaged": "yes"})
    with pytest.raises(ConfigError) as raised:
        validate_run(engine_copy)
    message = str(raised.value)
    assert "\n" not in message
    assert "skipped_steps: 'none' is not of type 'integer', 'null'" in message
    assert "precision_audit" in message


def test_a_metric_row_without_its_step_is_named(engine_copy) -> None:
    with (engine_copy / "metrics.jsonl").open("a") as rows:
        rows.write(json.dumps({"kind": "train", "loss": 1.0, "samples": 4}) + "\n")
    [problem] = run_problems(engine_copy)
    assert "metrics.jsonl line" in problem and "'step' is a required property" in problem


def test_an_eval_row_holds_only_eval_metrics() -> None:
    """A trainer's raw ``val_acc`` in an eval row would be a metric no report reads."""
    assert problems({"kind": "eval", "step": 1, "eval_acc": 0.5}, "metrics") == []
    assert problems({"kind": "eval", "step": 1, "val_acc": 0.5}, "metrics")


def test_a_summary_of_another_version_is_refused_in_one_line(engine_copy) -> None:
    rewrite_summary(engine_copy, **{VERSION_KEY: FORMAT_VERSION + 1})
    with pytest.raises(OtherFormatVersion, match=f"version {FORMAT_VERSION + 1}"):
        validate_run(engine_copy)


def test_a_summary_from_before_the_version_field_reads_as_version_1(engine_copy) -> None:
    summary = json.loads((engine_copy / "summary.json").read_text())
    del summary[VERSION_KEY]
    (engine_copy / "summary.json").write_text(json.dumps(summary))
    missing = f"summary.json (top): '{VERSION_KEY}' is a required property"
    assert run_problems(engine_copy) == [missing]


@pytest.mark.slow
def test_the_report_refuses_a_summary_of_another_version_in_one_line_exit_2(engine_copy) -> None:
    """Not listed as a failed run: a format it cannot read is the reader's problem, said once."""
    rewrite_summary(engine_copy, **{VERSION_KEY: 2})
    result = python_m("amp_exp.report", str(engine_copy))
    assert result.returncode == 2, result.stderr[-2000:]
    [line] = result.stderr.splitlines()
    assert "results format version 2; this amp_exp reads version 1" in line
