"""The sweep as a W&B Report: the page built against a stubbed W&B API, and the one-line failures
when the library, the API key or the server is missing.

The page is checked in wandb-workspaces' internal model (the JSON a report is saved as), which
pyproject.toml pins to a narrow range of the library.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from amp_exp.config.schema import ReportConfig
from amp_exp.report import wandb_report
from amp_exp.report.__main__ import main
from amp_exp.report.assemble import SweepReport, build_report
from amp_exp.report.runs import find_runs
from amp_exp.report.wandb_report import WandbReportError, build_page, sweep_page
from amp_exp.results.files import REPORT_MD, WANDB_RUN_ID_FILE
from amp_exp.tasks.lm import LanguageModelTask
from helpers.warm_python import python_m
from test_report import write_run
from test_wandb_cli import FAKE_API_KEY, UNREACHABLE_SERVER, env_without_wandb, run_at_terminal

wr = pytest.importorskip("wandb_workspaces.reports.v2")
# The page is built from the runs' rows, never from report.md's PNGs (conftest).
pytestmark = pytest.mark.usefixtures("pngs_not_rasterized")

PROJECT_ID = "UHJvamVjdDox"


def write_logged_run(
    path: Path,
    precision: str,
    lr: float,
    run_id: str | None,
    project: str = "amp_exp",
    online: bool = True,
    **summary_values: Any,
) -> None:
    """A run directory of a sweep over optimizer.lr that logged to W&B as ``run_id``."""
    summary = write_run(path, "tiny_cnn", precision, 1000.0, 0.8)
    summary["config"]["optimizer"] = {"name": "sgd", "lr": lr}
    summary["config"]["wandb"] = {"project": project, "entity": None, "mode": "auto"}
    summary.update(summary_values)
    (path / "summary.json").write_text(json.dumps(summary))
    if run_id is not None:
        (path / WANDB_RUN_ID_FILE).write_text(run_id)
        kind = "run" if online else "offline-run"
        (path / "wandb" / f"{kind}-20260131_120000-{run_id}").mkdir(parents=True)


def write_sweep(root: Path, **kwargs: Any) -> Path:
    jobs = [("fp32", 0.1), ("bf16", 0.1), ("fp16", 0.1), ("fp32", 0.05), ("bf16", 0.05)]
    for job, (precision, lr) in enumerate(jobs):
        write_logged_run(root / str(job), precision, lr, f"id{job}", **kwargs)
    return root


@pytest.fixture
def stub_wandb_api(monkeypatch) -> list[dict]:
    """The GraphQL calls a Report makes, answered without a server; returns their variables."""
    calls: list[dict] = []

    def execute_graphql(api: Any, query: str, variables: dict | None = None) -> dict:
        calls.append(dict(variables or {}))
        return {"project": {"internalId": PROJECT_ID}}

    monkeypatch.setattr(wr.interface, "execute_graphql", execute_graphql)
    monkeypatch.setattr(wr.interface, "_get_api", lambda: None)
    return calls


def page_model(root: Path) -> dict:
    """The sweep's page as the JSON W&B saves, and the report.md of the same runs."""
    report = build_report([root], root, tolerance=0.5)
    page = sweep_page(find_runs([root]), report, root)
    return build_page(page, "my-team")._to_model().model_dump(by_alias=True, exclude_none=True)


def panel_grid(model: dict) -> dict:
    (grid,) = [b for b in model["spec"]["blocks"] if b["type"] == "panel-grid"]
    return grid["metadata"]


def panels_by_type(model: dict) -> dict[str, list[dict]]:
    panels: dict[str, list[dict]] = {}
    for panel in panel_grid(model)["panelBankSectionConfig"]["panels"]:
        panels.setdefault(panel["viewType"], []).append(panel["config"])
    return panels


def test_the_page_shows_only_the_sweeps_runs_grouped_by_the_precision_that_ran(
    tmp_path: Path, stub_wandb_api
) -> None:
    write_sweep(tmp_path / "sweep")
    write_logged_run(tmp_path / "sweep" / "5", "fp16", 0.05, run_id=None)  # logged without W&B
    model = page_model(tmp_path / "sweep")
    (runset,) = panel_grid(model)["runSets"]
    assert runset["project"] == {"name": "amp_exp", "entityName": "my-team", "id": PROJECT_ID}
    assert runset["filters"]["filters"] == [
        {
            "key": {"section": "run", "name": "name"},  # W&B's backend name of the run ID
            "op": "IN",
            "value": ["id0", "id1", "id2", "id3", "id4"],
            "disabled": False,
        }
    ]
    # precision.resolved is a flat key of the W&B config, so ".value" comes last.
    # A group per precision and setting: the swept learning rate is nested in the W&B config.
    assert runset["grouping"] == [
        {"section": "config", "name": "precision.resolved.value"},
        {"section": "config", "name": "optimizer.value.lr"},
    ]
    assert model["project"] == {"name": "amp_exp", "entityName": "my-team"}
    assert stub_wandb_api == [{"entityName": "my-team", "projectName": "amp_exp"}]


def test_the_page_charts_loss_scale_skips_accuracy_throughput_memory_and_the_swept_keys(
    tmp_path: Path, stub_wandb_api
) -> None:
    panels = panels_by_type(page_model(write_sweep(tmp_path / "sweep")))
    lines = panels["Run History Line Plot"]
    assert {line["xAxis"] for line in lines} == {"samples"}
    assert [line["metrics"] for line in lines] == [
        ["train/loss"],
        ["amp/scale", "amp/scale_mean"],
        ["amp/skip_rate"],
        ["eval/acc"],
    ]
    assert [bar["metrics"] for bar in panels["Bar Chart"]] == [
        ["perf/samples_per_s"],
        ["perf/peak_mem_bytes"],
        # Each run's matmul FLOPs by dtype, from its precision audit.
        [f"audit/flops_share/{dtype}" for dtype in ("float32", "bfloat16", "float16")],
    ]
    (parallel,) = panels["Parallel Coordinates Plot"]
    assert [column["accessor"] for column in parallel["columns"]] == [
        "config:precision.resolved.value",
        "config:optimizer.value.lr",  # the swept key; nested in the W&B config
        "summary:perf/samples_per_s.last",
        "summary:perf/peak_mem_bytes.max",
        "summary:eval/acc",
    ]


def test_the_page_carries_the_verdicts_and_the_table_of_report_md(
    tmp_path: Path, stub_wandb_api
) -> None:
    root = write_sweep(tmp_path / "sweep")
    model = page_model(root)
    report_md = (root / REPORT_MD).read_text()
    markdown = [b["content"] for b in model["spec"]["blocks"] if b["type"] == "markdown-block"]
    verdicts, evidence, table = markdown
    assert verdicts.startswith("- tiny_cnn (optimizer.lr=0.1): bf16 against fp32 on a single")
    assert all(line in report_md for line in verdicts.splitlines())
    assert evidence.splitlines()[0].startswith("| model | setting | precision | n | metric |")
    assert evidence in report_md
    assert table.splitlines()[0].startswith("| run | model | precision | result |")
    assert "| tiny_cnn (optimizer.lr=0.1) | bf16 |" in table
    assert table in report_md
    assert model["displayName"] == f"amp_exp sweep {tmp_path.name} sweep"


def test_the_seeds_of_a_precision_are_one_line_their_mean_in_a_min_max_band(
    tmp_path: Path, stub_wandb_api
) -> None:
    root = tmp_path / "sweep"
    for job, (precision, seed) in enumerate([(p, s) for p in ("fp32", "bf16") for s in (0, 1)]):
        write_logged_run(root / str(job), precision, 0.1, f"id{job}")
        summary = json.loads((root / str(job) / "summary.json").read_text())
        summary["config"]["seed"] = seed
        (root / str(job) / "summary.json").write_text(json.dumps(summary))
    model = page_model(root)
    (runset,) = panel_grid(model)["runSets"]
    assert runset["grouping"] == [{"section": "config", "name": "precision.resolved.value"}]
    for line in panels_by_type(model)["Run History Line Plot"]:
        assert (line["groupAgg"], line["groupArea"]) == ("mean", "minmax")


def test_language_model_runs_are_charted_by_their_quality_metric_and_tokens_per_second(
    tmp_path: Path, stub_wandb_api
) -> None:
    lm = {"task_metrics": LanguageModelTask.metrics.as_dict(), "eval_acc": None}
    sweep = write_sweep(tmp_path / "sweep", eval_loss=3.4, tokens_per_s=9000.0, **lm)
    panels = panels_by_type(page_model(sweep))
    # The LM task declares its eval loss as the quality metric.
    assert [line["metrics"] for line in panels["Run History Line Plot"]][-1] == ["eval/loss"]
    assert panels["Bar Chart"][0]["metrics"] == ["perf/tokens_per_s"]
    (parallel,) = panels["Parallel Coordinates Plot"]
    assert "summary:eval/loss" in [column["accessor"] for column in parallel["columns"]]


def test_runs_without_a_wandb_run_id_give_a_one_line_error(tmp_path: Path) -> None:
    write_logged_run(tmp_path / "0", "fp32", 0.1, run_id=None)
    runs = find_runs([tmp_path])
    report = build_report([tmp_path], tmp_path, tolerance=0.5)
    with pytest.raises(WandbReportError, match="no run directory holds a wandb_run_id file"):
        sweep_page(runs, report, tmp_path)


def test_runs_logged_to_two_projects_give_a_one_line_error(tmp_path: Path) -> None:
    write_logged_run(tmp_path / "0", "fp32", 0.1, "a", project="one")
    write_logged_run(tmp_path / "1", "bf16", 0.1, "b", project="two")
    report = build_report([tmp_path], tmp_path, tolerance=0.5)
    with pytest.raises(WandbReportError, match=r"more than one W&B project \(\(default\)/one, "):
        sweep_page(find_runs([tmp_path]), report, tmp_path)


class FakeApi:
    """wandb.Api that knows the key's default entity and answers nothing else."""

    def __init__(self, timeout: int) -> None:
        self.default_entity = "my-team"


def test_the_command_saves_the_page_to_the_keys_entity_and_prints_its_url(
    tmp_path: Path, stub_wandb_api, monkeypatch, capsys
) -> None:
    import wandb

    root = write_sweep(tmp_path / "sweep")
    saved: list[Any] = []

    def save(report: Any, **kwargs: Any) -> Any:
        saved.append(report)
        report.id = "Vmlldzox"
        return report

    monkeypatch.setenv("WANDB_API_KEY", FAKE_API_KEY)
    monkeypatch.setattr(wandb_report, "unreachable", lambda url, timeout: None)
    monkeypatch.setattr(wandb, "Api", FakeApi)
    monkeypatch.setattr(wr.Report, "save", save)
    monkeypatch.setattr(wr.interface, "get_app_url", lambda api: "https://wandb.example")
    assert main([str(root), "--wandb"]) == 0
    (report,) = saved
    assert report.entity == "my-team" and report.project == "amp_exp"
    url = (
        f"https://wandb.example/my-team/amp_exp/reports/{report.title.replace(' ', '-')}--Vmlldzox"
    )
    assert capsys.readouterr().out.splitlines()[-1] == f"W&B report: {url}"


def test_a_server_that_never_answers_is_given_up_at_the_deadline(
    tmp_path: Path, monkeypatch
) -> None:
    import wandb

    root = write_sweep(tmp_path / "sweep")
    report = build_report([root], root, tolerance=0.5)
    page = sweep_page(find_runs([root]), report, root)
    monkeypatch.setenv("WANDB_API_KEY", FAKE_API_KEY)
    monkeypatch.setattr(wandb_report, "unreachable", lambda url, timeout: None)
    monkeypatch.setattr(wandb, "Api", lambda timeout: time.sleep(10))
    started = time.monotonic()
    with pytest.raises(WandbReportError) as raised:
        wandb_report.save_page(page, timeout=0.5)
    assert time.monotonic() - started < 5
    assert str(raised.value).endswith(
        " did not answer within 0.5 s (report.wandb_timeout, --wandb-timeout)"
    )


def test_a_server_that_accepts_but_never_replies_is_unreachable_after_the_timeout() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()  # connections complete in the kernel; nothing ever reads or replies
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        assert wandb_report.unreachable(url, timeout=0.5) == "TimeoutError: timed out"
    assert wandb_report.unreachable(url, timeout=0.5).startswith("ConnectionRefusedError:")


def test_without_wandb_workspaces_the_error_names_the_extra_to_install(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    root = write_sweep(tmp_path / "sweep")
    # A None entry makes ``import`` raise ImportError, as when the package is not installed.
    monkeypatch.setitem(sys.modules, "wandb_workspaces.reports.v2", None)
    assert main([str(root), "--wandb"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(
        "amp_exp.report: error: a W&B report needs wandb-workspaces: "
        "pip install 'amp_exp[wandb-report]'"
    )
    assert (root / REPORT_MD).is_file()


def report_cli(root: Path, home: Path, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """``python -m amp_exp.report ROOT --wandb`` in a home without W&B credentials (matplotlib
    keeps the session's cache: conftest.py)."""
    env = env_without_wandb(home, **env)
    started = time.monotonic()
    result = python_m("amp_exp.report", str(root), "--wandb", timeout=120, env=env)
    return result, time.monotonic() - started


@pytest.mark.slow
def test_with_no_server_the_command_stops_in_one_line_within_30_s_after_report_md(
    tmp_path: Path,
) -> None:
    root = write_sweep(tmp_path / "sweep")
    result, seconds = report_cli(
        root, tmp_path / "home", WANDB_API_KEY=FAKE_API_KEY, WANDB_BASE_URL=UNREACHABLE_SERVER
    )
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith(
        f"amp_exp.report: error: no W&B report: cannot reach {UNREACHABLE_SERVER} "
        "(ConnectionRefusedError: "
    )
    assert seconds < 30
    assert (root / REPORT_MD).is_file()
    assert f"report: {root / REPORT_MD}" in result.stdout


@pytest.mark.slow
def test_what_matplotlib_says_of_its_cache_never_adds_a_line_to_the_error(tmp_path: Path) -> None:
    """A config folder matplotlib cannot use (here a file; in a fresh home, none yet): it warns,
    and builds its font cache in a temporary folder, through the logging module."""
    root = write_sweep(tmp_path / "sweep")
    (tmp_path / "not_a_folder").write_text("")
    result, _ = report_cli(
        root,
        tmp_path / "home",
        WANDB_API_KEY=FAKE_API_KEY,
        WANDB_BASE_URL=UNREACHABLE_SERVER,
        MPLCONFIGDIR=str(tmp_path / "not_a_folder"),
    )
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("amp_exp.report: error: no W&B report: cannot reach")
    assert (root / "loss_curves.png").is_file()


@pytest.mark.slow
def test_without_an_api_key_the_command_stops_in_one_line_and_never_prompts(
    tmp_path: Path,
) -> None:
    root = write_sweep(tmp_path / "sweep")
    env = env_without_wandb(tmp_path / "home", WANDB_BASE_URL=UNREACHABLE_SERVER)
    command = [sys.executable, "-m", "amp_exp.report", str(root), "--wandb"]
    returncode, output = run_at_terminal(command, env, timeout=120)
    assert returncode == 2
    assert output.splitlines()[-1] == (
        "amp_exp.report: error: no W&B report: no API key is configured "
        "(set WANDB_API_KEY or run `wandb login`)"
    )
    assert (root / REPORT_MD).is_file()


def sweep_callback(root: Path) -> SweepReport:
    callback = SweepReport()
    callback.sweep_dir = root
    callback.settings = ReportConfig(wandb=True)
    return callback


def test_a_sweep_that_logged_offline_gets_report_md_and_a_pointer_to_the_command(
    tmp_path: Path, caplog
) -> None:
    root = write_sweep(tmp_path / "sweep", online=False)
    with caplog.at_level(logging.INFO, logger="amp_exp"):
        sweep_callback(root).build()
    assert (root / REPORT_MD).is_file()
    assert (
        f"no W&B report: the runs logged offline: after `wandb sync`, make it with "
        f"`python -m amp_exp.report {root} --wandb`"
    ) in caplog.messages


def test_a_w_and_b_report_that_fails_never_fails_the_sweep(
    tmp_path: Path, caplog, monkeypatch
) -> None:
    root = write_sweep(tmp_path / "sweep")

    def fail(*args: Any, **kwargs: Any) -> str:
        raise RuntimeError("the server said no")

    monkeypatch.setattr(wandb_report, "save_page", fail)
    sweep_callback(root).build()  # raises nothing
    assert "no W&B report: the server said no" in caplog.messages
    assert (root / REPORT_MD).is_file()
