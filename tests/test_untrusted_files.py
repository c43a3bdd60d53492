"""Files in an output directory are data, never trusted as if this command had just written them:
a planted link, a FIFO, a file too large or nested too deep is refused in one line (exit 2) and
nothing is changed; a run whose metrics.jsonl is missing or cut short is listed as damaged; what
a run recorded reaches report.md and the W&B Report as text, never as markup."""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import pytest

from amp_exp.errors import EXIT_CONFIG_ERROR
from amp_exp.report.__main__ import main
from amp_exp.report.assemble import build_report
from amp_exp.report.markdown import verdict_lines
from amp_exp.report.runs import find_runs
from amp_exp.report.sequential import read_plan
from amp_exp.report.wandb_report import sweep_page
from amp_exp.report.words import md_text
from amp_exp.results.checkpoint import (
    UnusableCheckpoints,
    load_newest_valid,
    remove_stale_temporaries,
)
from amp_exp.results.files import (
    MAX_DEPTH,
    WANDB_RUN_ID_FILE,
    UntrustedFile,
    parse_json,
    read_data,
    read_json,
)
from amp_exp.results.loggers import JsonlLogger
from amp_exp.results.ownership import LOCK_FILE, RunDirectoryLock
from amp_exp.results.summary import completed_summary
from amp_exp.results.wandb_logger import open_wandb_logger
from helpers.fake_wandb import install_fake_wandb
from helpers.runs import FAST, TINY
from helpers.warm_python import python_m
from test_report import rows_by_run, write_run

PRECIOUS = "a file the user keeps elsewhere\n"


def precious(tmp_path: Path) -> Path:
    target = tmp_path / "elsewhere.txt"
    target.write_text(PRECIOUS)
    return target


def two_runs(root: Path) -> Path:
    write_run(root / "0", "tiny_cnn", "fp32", 1000.0, 0.8)
    write_run(root / "1", "tiny_cnn", "bf16", 1500.0, 0.8)
    return root


def report_error(root: Path, capsys) -> str:
    """The report's one line of error for ``root``; fails unless it exits 2 in one line."""
    assert main([str(root)]) == EXIT_CONFIG_ERROR
    [line] = capsys.readouterr().err.splitlines()
    return line


# --- the lock ---------------------------------------------------------------------------------


def test_a_planted_symlink_lock_is_refused_and_the_file_it_points_at_is_untouched(
    tmp_path,
) -> None:
    """Caught: the lock opened with O_CREAT alone follows the link and truncates the target."""
    target = precious(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).symlink_to(target)
    with pytest.raises(UntrustedFile) as refused, RunDirectoryLock(run_dir):
        pass
    assert refused.value.exit_status == EXIT_CONFIG_ERROR
    assert str(refused.value) == (
        f"{run_dir / LOCK_FILE} is a symbolic link; amp_exp never writes one there, so it reads "
        "and writes nothing through it: replace it with the file itself"
    )
    assert target.read_text() == PRECIOUS


def test_a_dangling_symlink_lock_creates_nothing_where_it_points(tmp_path) -> None:
    """Caught: O_CREAT through a dangling link creates the file it names, anywhere."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).symlink_to(tmp_path / "created_through_the_link")
    with pytest.raises(UntrustedFile), RunDirectoryLock(run_dir):
        pass
    assert not (tmp_path / "created_through_the_link").exists()


@pytest.mark.slow
def test_cli_a_planted_symlink_lock_exits_2_in_one_line_and_writes_nothing(tmp_path) -> None:
    target = precious(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).symlink_to(target)
    result = python_m("amp_exp", *FAST, *TINY, f"hydra.run.dir={run_dir}", timeout=300)
    assert result.returncode == EXIT_CONFIG_ERROR, result.stderr[-2000:]
    assert "Traceback" not in result.stdout + result.stderr
    [line] = result.stderr.splitlines()
    assert line.endswith(
        f"{run_dir / LOCK_FILE} is a symbolic link; amp_exp never writes one "
        "there, so it reads and writes nothing through it: replace it with the "
        "file itself"
    )
    assert target.read_text() == PRECIOUS
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]


@pytest.mark.parametrize("append", [False, True], ids=["fresh", "resumed"])
def test_a_planted_metrics_link_is_refused_and_the_file_it_points_at_is_untouched(
    tmp_path, append
) -> None:
    """Caught: metrics.jsonl opened with open("w") truncates whatever a planted link names."""
    target = precious(tmp_path)
    (tmp_path / "metrics.jsonl").symlink_to(target)
    with pytest.raises(UntrustedFile, match=r"metrics\.jsonl is a symbolic link"):
        JsonlLogger(tmp_path / "metrics.jsonl", append=append)
    assert target.read_text() == PRECIOUS


# --- reading as data ---------------------------------------------------------------------------


def test_a_symlinked_summary_stops_the_report_in_one_line_and_writes_nothing(
    tmp_path, capsys
) -> None:
    """Caught: a summary.json read through a link reports, as this sweep's, any file it names."""
    root = two_runs(tmp_path / "sweep")
    elsewhere = tmp_path / "summary_elsewhere.json"
    (root / "1" / "summary.json").rename(elsewhere)
    (root / "1" / "summary.json").symlink_to(elsewhere)
    assert report_error(root, capsys).endswith(
        f"{root / '1' / 'summary.json'} is a symbolic link; amp_exp never writes one there, so it "
        "reads and writes nothing through it: replace it with the file itself"
    )
    assert not (root / "report.md").exists()


def test_a_deeply_nested_summary_is_one_line_not_a_recursion_error(tmp_path, capsys) -> None:
    """Caught: json.loads on 100000 nested arrays raises RecursionError (a traceback, exit 1)."""
    root = two_runs(tmp_path / "sweep")
    (root / "1" / "summary.json").write_text("[" * 100_000 + "]" * 100_000)
    assert report_error(root, capsys).endswith(
        f"{root / '1' / 'summary.json'} nests deeper than {MAX_DEPTH} levels, deeper than "
        "anything amp_exp writes; remove it"
    )
    assert not (root / "report.md").exists()


def test_nesting_is_counted_outside_strings_and_the_limit_itself_is_read() -> None:
    """Caught: brackets inside a string counted as nesting (a run named "[[[[" refused), or a
    limit off by one."""
    path = Path("x.json")
    deepest = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    brackets_in_strings = json.dumps({"name": "[{" * 500 + '\\"[' * 100})
    with_escapes = json.dumps(["\\" * 3 + "[" * 200])
    for fine in (deepest, brackets_in_strings, with_escapes):
        assert parse_json(fine.encode(), path) == json.loads(fine)
    with pytest.raises(UntrustedFile, match="nests deeper than"):
        parse_json(b"[" + deepest.encode() + b"]", path)


def test_a_string_left_open_is_read_in_one_pass_not_once_per_quote_in_it() -> None:
    """Caught: a string pattern that needs its closing quote retries from every escaped quote of
    an open string: a few MB of them took hours."""
    hostile = b"[[]" + b"[]" * MAX_DEPTH + b'"' + b'\\"' * 2_000_000
    outcome: list[BaseException] = []

    def parse() -> None:
        try:
            parse_json(hostile, Path("summary.json"))
        except ValueError as error:
            outcome.append(error)

    parsing = threading.Thread(target=parse, daemon=True)
    parsing.start()
    parsing.join(timeout=60)
    [error] = outcome
    assert not isinstance(error, UntrustedFile)  # 2 deep, then a string left open: no JSON


def test_a_fifo_named_summary_json_is_refused_without_waiting_for_a_writer(
    tmp_path, capsys
) -> None:
    """Caught: open() on a FIFO blocks until a writer comes: the report hangs for ever."""
    root = two_runs(tmp_path / "sweep")
    (root / "1" / "summary.json").unlink()
    os.mkfifo(root / "1" / "summary.json")
    outcome: list[int] = []
    reporter = threading.Thread(target=lambda: outcome.append(main([str(root)])), daemon=True)
    reporter.start()
    reporter.join(timeout=60)
    assert outcome == [EXIT_CONFIG_ERROR], "the report hung on the FIFO"
    [line] = capsys.readouterr().err.splitlines()
    assert line.endswith(
        f"{root / '1' / 'summary.json'} is a FIFO, not a file amp_exp wrote; remove it"
    )


def test_a_file_larger_than_its_limit_is_refused_before_it_is_parsed(tmp_path) -> None:
    """Caught: a file of any size read whole into memory."""
    path = tmp_path / "summary.json"
    path.write_bytes(b" " * (2 * 2**20 + 1) + b"{}")
    with pytest.raises(UntrustedFile, match="holds over 2 MiB, more than amp_exp writes there"):
        read_data(path, limit=2 * 2**20)
    assert read_json(path, limit=3 * 2**20) == {}


def test_a_run_directory_whose_summary_is_a_link_is_refused_not_taken_for_empty(tmp_path) -> None:
    """Caught: completed_summary swallowing the refusal, so that a new run takes the directory."""
    target = tmp_path / "completed.json"
    target.write_text(json.dumps({"status": "completed"}))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").symlink_to(target)
    with pytest.raises(UntrustedFile, match="is a symbolic link"):
        completed_summary(tmp_path / "run")


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b'{"plan": {"min_seeds": 2', "Expecting"),
        (b'{"plan": {"min_seeds": "two"}}', "its fields are not those amp_exp writes there"),
        (b"[]", "its fields are not those amp_exp writes there"),
    ],
    ids=["cut", "wrong kind", "not an object"],
)
def test_a_corrupt_evidence_json_is_one_line_exit_2(tmp_path, capsys, content, why) -> None:
    """Caught: a corrupt evidence.json read with json.loads and Plan(**...): a traceback."""
    root = two_runs(tmp_path / "sweep")
    (root / "evidence.json").write_bytes(content)
    with pytest.raises(UntrustedFile, match=f"evidence.json is damaged \\({why}"):
        read_plan(root)
    line = report_error(root, capsys)
    assert f"{root / 'evidence.json'} is damaged ({why}" in line
    assert line.endswith("nothing was changed: restore it or remove it")
    assert (root / "evidence.json").read_bytes() == content


def test_a_stale_checkpoint_temporary_that_is_a_link_goes_and_its_target_stays(tmp_path) -> None:
    """Caught: rmtree on a planted .step_<N>.tmp link (an OSError on resume), or a removal that
    reaches the directory it names."""
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text(PRECIOUS)
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / ".step_00000004.tmp").symlink_to(kept, target_is_directory=True)
    assert remove_stale_temporaries(tmp_path / "run") == [checkpoints / ".step_00000004.tmp"]
    assert not (checkpoints / ".step_00000004.tmp").is_symlink()
    assert (kept / "notes.txt").read_text() == PRECIOUS


def test_a_planted_wandb_run_id_link_starts_a_new_wandb_run_and_never_stops_the_run(
    run_cfg, tmp_path, monkeypatch, caplog
) -> None:
    """Caught: the W&B id read through a link (resuming whatever run it names), or its refusal
    stopping training, which W&B, being optional, never does."""
    fake = install_fake_wandb(monkeypatch)
    (tmp_path / "someone_elses_id").write_text("their-run")
    (tmp_path / WANDB_RUN_ID_FILE).symlink_to(tmp_path / "someone_elses_id")
    cfg = run_cfg("wandb.mode=offline")
    assert open_wandb_logger(cfg, tmp_path, "fp32", "cpu", 4, None, tmp_path) is not None
    (init,) = fake.called("init")
    assert "id" not in init and "resume" not in init
    assert f"{tmp_path / WANDB_RUN_ID_FILE} is a symbolic link" in caplog.text
    assert "this run starts a new W&B run" in caplog.text


def test_a_fifo_found_as_a_step_checkpoint_is_unusable_not_a_hang(tmp_path) -> None:
    """Caught: torch.load on a FIFO in checkpoints/ blocking the resume for ever."""
    fifo = tmp_path / "checkpoints" / "step_00000004.pt"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    outcome: list[BaseException] = []

    def resume() -> None:
        try:
            load_newest_valid(tmp_path)
        except UnusableCheckpoints as unusable:
            outcome.append(unusable)

    looking = threading.Thread(target=resume, daemon=True)
    looking.start()
    looking.join(timeout=60)
    [unusable] = outcome
    assert unusable.reasons[fifo] == f"{fifo} is a FIFO, not a file amp_exp wrote; remove it"


# --- damaged runs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        ("deleted", "its metrics.jsonl is missing"),
        ("cut", "its metrics.jsonl ends in a line cut short"),
        ("short", "its metrics.jsonl logs training to step 2 of 3"),
    ],
)
def test_a_completed_run_with_a_damaged_metrics_jsonl_is_listed_and_not_judged(
    tmp_path, damage, why
) -> None:
    """Caught: a run whose metrics.jsonl was deleted or cut judged as if its record were whole."""
    root = tmp_path / "sweep"
    write_run(root / "0", "tiny_cnn", "fp32", 1000.0, 0.8)
    summary = write_run(root / "1", "tiny_cnn", "bf16", 1500.0, 0.8)
    (root / "1" / "summary.json").write_text(json.dumps({**summary, "steps": 3}))
    metrics = root / "1" / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    if damage == "deleted":
        metrics.unlink()
    elif damage == "cut":
        metrics.write_text("".join(lines)[:-20])
    else:
        metrics.write_text("".join(lines[:2]))
    report = build_report([root], root, tolerance=0.5)
    row = rows_by_run(report)["1"]
    assert (row["status"], row["error"]) == ("damaged", why)
    [comparison] = report["comparisons"]
    assert comparison["n"] == 0 and comparison["verdict"] == "incomplete"
    [failed] = comparison["failed_seeds"]
    assert (failed["run"], failed["status"]) == ("1", "damaged")
    report_md = (root / "report.md").read_text()
    assert f"- `1` (tiny_cnn bf16) damaged ({why})" in report_md


# --- report.md is text -------------------------------------------------------------------------


HOSTILE = "<script>alert(1)</script>[x](javascript:alert(2))|`"


def test_md_text_leaves_names_as_they_are_and_neutralises_markup() -> None:
    """Caught: a name that opens a tag, a link, a code span or a table cell in the page, or
    amp_exp's own names (tiny_cnn, bf16_true) mangled by escapes."""
    assert md_text("tiny_cnn bf16_true 0.1") == "tiny_cnn bf16_true 0.1"
    assert md_text(HOSTILE) == (
        "&lt;script&gt;alert(1)&lt;/script&gt;\\[x\\](javascript:alert(2))\\|\\`"
    )
    assert md_text("\\[x](y)") == "\\\\\\[x\\](y)"  # a backslash cannot undo the escape after it
    assert md_text("_x_ *y* a\nb") == "\\_x\\_ \\*y\\* a b"


def test_a_hostile_model_name_reaches_report_md_and_the_wandb_page_as_text(tmp_path) -> None:
    """Caught: report.md (and the W&B Report built from the same lines) copying a model name
    with <script> or a markdown link into the rendered page."""
    root = tmp_path / "sweep"
    for job, precision in enumerate(("fp32", "bf16")):
        summary = write_run(root / str(job), HOSTILE, precision, 1000.0 + job, 0.8)
        summary["config"]["wandb"] = {"project": "amp_exp", "entity": None}
        (root / str(job) / "summary.json").write_text(json.dumps(summary))
        (root / str(job) / WANDB_RUN_ID_FILE).write_text(f"id{job}")
    report = build_report([root], root, tolerance=0.5)
    report_md = (root / "report.md").read_text()
    assert "<script>" not in report_md
    assert not re.search(r"(?<!\\)\]\(javascript:", report_md)  # no link: its ] is escaped
    escaped = md_text(HOSTILE)
    assert f"| 0 | {escaped} | fp32 |" in report_md  # the Runs table
    assert f"- **{escaped}: " in report_md  # the recommendation
    assert f"| {escaped} | bf16 |" in report_md  # the evidence table
    assert report["runs"][0]["model"] == HOSTILE  # report.json keeps the data as it was
    page = sweep_page(find_runs([root]), report, root)
    assert page.verdicts == tuple(verdict_lines(report))
    assert all(line in report_md for line in page.verdicts + page.evidence + page.table)
    assert not any("<script>" in line for line in page.verdicts + page.evidence + page.table)


def test_hostile_recorded_values_reach_speed_predict_and_sensitivity_md_as_text() -> None:
    """Caught: speed.md, predict.md or sensitivity.md copying a recorded model, device,
    precision, module, op or error text with <script> or a markdown link into the page."""
    from amp_exp.capability.ratio import speedup
    from amp_exp.predict.markdown import prediction_markdown
    from amp_exp.sensitivity.results import markdown as sensitivity_markdown
    from amp_exp.speed.trial import trial_markdown

    pair = {
        "ms_per_applied_step": {"fp32": 12.0, HOSTILE: 10.0},
        "warmup_steps": {"fp32": 10, HOSTILE: 10},
        "steady": {"fp32": True, HOSTILE: True},
        "skipped_steps": {"fp32": 0, HOSTILE: 0},
    }
    found = speedup([1.2, 1.3, 1.1, 1.2, 1.25, 1.15], [1.0] * 6, 1.2).as_dict()
    trial = {
        **dict.fromkeys(("model", "setting", "device_name"), HOSTILE),
        "stand_in": None,
        **{
            "samples_per_step": 8,
            "max_warmup_steps": 10,
            "warmup_level": 0.05,
            "rounds": 6,
            "max_rounds": 6,
        },
        **{"target_halfwidth": 0.05, "steps": 5, "pairs": {HOSTILE: pair}},
        **{"speedup": {HOSTILE: found}, "not_timed": {HOSTILE: HOSTILE}},
    }
    failed = {"model": HOSTILE, "error": HOSTILE}
    row = {"why": HOSTILE, "format_flop_share": None, "caveat": HOSTILE}
    model = {"unit": "tokens", "parameters": 1, "batch_size": 1, "units_per_sample": 1}
    prediction = {
        "model": {**model, "flops_per_step": 1e12, "traced_ops": 1},
        "world_size": 1,
        "devices": {HOSTILE: {"label": HOSTILE, "precisions": {HOSTILE: row}, "sources": []}},
        "assumptions": [],
        "interval_rate": 0.8,
        "interval_factors": {"throughput": 1.5, "speedup": 1.3},
    }
    module = {
        "rank": 1,
        **dict.fromkeys(("output_sqnr_db", "output_floor_db", "grad_sqnr_db"), 30.0),
        **{"grad_floor_db": 30.0, "output_finite": True, "grad_finite": True, "margin_db": 5.0},
        **dict.fromkeys(
            ("activation_overflow_frac", "gradient_overflow_frac", "gradient_underflow_frac"), 0.0
        ),
        "out_of_range_op": HOSTILE,
    }
    sensitivity = {
        "model": HOSTILE,
        "precisions": [HOSTILE],
        "batches": 1,
        "sensitive_when": "below the floor",
        "loss": {
            "fp32": 1.0,
            HOSTILE: {"loss": 1.0, "finite": True, "rel_error": 0.0, "out_of_range_op": HOSTILE},
        },
        "modules": [{"name": HOSTILE, "type": HOSTILE, "flop_share": 1.0, HOSTILE: module}],
        "rankings": {HOSTILE: [HOSTILE]},
    }
    pages = {
        "speed.md": trial_markdown([trial, failed]),
        "predict.md": prediction_markdown(prediction),
        "sensitivity.md": sensitivity_markdown(sensitivity, show=5),
    }
    for name, page in pages.items():
        assert "<script>" not in page, name
        assert not re.search(r"(?<!\\)\]\(javascript:", page), name
        assert md_text(HOSTILE) in page, name
    assert f"| {md_text(HOSTILE)} | 12 / 10 | " in pages["speed.md"]
    assert f"The trial failed: {md_text(HOSTILE)}" in pages["speed.md"]
    assert f"| 1 | {md_text(HOSTILE)} | {md_text(HOSTILE)} | " in pages["sensitivity.md"]
