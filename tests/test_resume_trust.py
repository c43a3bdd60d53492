"""Results are data, and a resume continues what was planned.

- No command imports a module named by a file in an output directory: a canary module, whose
  import leaves a file, named in a run's summary.json, a killed job's .hydra/config.yaml or a
  resumed sweep's .hydra/overrides.yaml, is never imported (the report, the sweep's speed trial,
  the evidence sweeper's resume).
- What is trained cannot change on resume: precision options included; one list of what may.
- A sweep resumes what it planned: an evidence sweep SIGKILLed in its second look and resumed
  ends with the looks, seeds and verdicts of the uninterrupted one; a sweep resumed with its
  values in another order finds each job's own directory; a directory of another experiment, or
  a raised evidence.max_seeds, is refused in one line with nothing written.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from amp_exp.config.schema import SchedulerConfig, SchedulerName
from amp_exp.errors import ConfigError, RunRefused
from amp_exp.report.runs import Run
from amp_exp.results.files import EVIDENCE_JSON, write_json
from amp_exp.results.resume import config_changes, trained_values
from amp_exp.run import train
from amp_exp.speed.sweep import trial_config
from amp_exp.training.optim import build_scheduler
from helpers.runs import FAST, TINY
from helpers.warm_python import python_m, start_python_m

ROOT = Path(__file__).resolve().parent.parent
CANARY_MODULE = "canary_plugin"
CANARY = f"{CANARY_MODULE}.Plugin"
# Each sweep: a 16-wide MLP on 8x8 images (no convolutions), 4 steps, no trial, no audit (which
# only adds time here).
SWEEP = [
    *FAST,
    "model=mlp",
    "model.hidden_dim=16",
    "dataset.image_size=8",
    "report.speed_trial=false",
    "diagnostics.audit=false",
]


def plant_canary(folder: Path) -> Path:
    """A module whose import writes ``imported`` beside it; returns that file's path."""
    marker = folder / "imported"
    (folder / f"{CANARY_MODULE}.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('imported')\nPlugin = None\n"
    )
    return marker


def amp_exp(module: str, *args: str, canary_dir: Path) -> subprocess.CompletedProcess:
    """``python -m <module> args`` with the canary's folder on the path, as a user's own module
    would be: importing it by name would succeed."""
    return python_m(module, *args, env=with_canary(canary_dir), timeout=300)


def with_canary(canary_dir: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(canary_dir), str(ROOT)])}


def refused_before_hydra(amp_exp_here, monkeypatch, canary_dir: Path, *args: str) -> str:
    """``python -m amp_exp args`` through its entry point, in this process, with the canary's
    folder on the path as ``amp_exp`` puts it: refused (exit 2) before Hydra starts. Its
    stderr."""
    monkeypatch.syspath_prepend(str(canary_dir))
    result = amp_exp_here(*args)
    assert result.returncode == 2, result.stderr[-2000:]
    return result.stderr


def test_the_canary_is_imported_when_named_on_the_path(tmp_path: Path) -> None:
    """The control: the canary, on the path, leaves its file when imported, so the tests below
    that find no file would catch an import."""
    marker = plant_canary(tmp_path)
    result = amp_exp("canary_plugin", canary_dir=tmp_path)
    assert result.returncode == 0 and marker.exists()


@pytest.mark.usefixtures("pngs_not_rasterized")  # read for its words (conftest)
def test_a_report_over_runs_naming_a_canary_never_imports_it(
    run_cfg, tmp_path: Path, monkeypatch, command_main
) -> None:
    """A completed run's summary.json names the canary as its precision plugin (with the facts
    its run recorded) and a killed job's saved config names it as model and precision: the
    report shows the run by its recorded label, and nothing imports the canary. The report
    runs through its entry point in this process, the canary's folder on the path as
    ``amp_exp`` puts it (and no canary imported before, whose cached module would import
    without leaving its file)."""
    assert CANARY_MODULE not in sys.modules
    marker = plant_canary(tmp_path)
    runs = tmp_path / "runs"
    train(run_cfg(*FAST, *TINY, "precision=fp32"), runs / "fp32")
    shutil.copytree(runs / "fp32", runs / "mine")
    summary = json.loads((runs / "mine" / "summary.json").read_text())
    summary["precision"] = summary["config"]["precision"]["name"] = "mine"
    summary["config"]["precision"]["_target_"] = CANARY
    summary["precision_facts"] = {
        "label": "mine (recorded label)",
        "order": 7,
        "colour": "#123456",
        "grad_scaler": False,
        "stall_advice": "recorded advice",
    }
    (runs / "mine" / "summary.json").write_text(json.dumps(summary))
    killed = runs / "killed" / ".hydra"
    killed.mkdir(parents=True)
    config = dict(summary["config"])
    config["model"] = {"name": "custom", "_target_": CANARY, "kwargs": {}}
    (killed / "config.yaml").write_text(yaml.safe_dump(config))

    monkeypatch.syspath_prepend(str(tmp_path))
    result = command_main("amp_exp.report", str(runs))
    assert result.returncode == 0, result.stderr[-2000:]
    assert not marker.exists()
    assert "mine (recorded label)" in (runs / "report.md").read_text()


def test_the_sweeps_speed_trial_refuses_code_its_command_line_did_not_name(tmp_path) -> None:
    """The speed trial rebuilds each job from its summary's config: one naming code the sweep's
    command line and config do not name is refused before anything is imported."""
    marker = plant_canary(tmp_path)
    sys.path.insert(0, str(tmp_path))
    try:
        config = {"model": {"name": "custom", "_target_": CANARY}, "precision": {"name": "fp32"}}
        run = Run(tmp_path, {"config": config}, [])
        with pytest.raises(ConfigError, match=f"names model._target_={CANARY}, which this sweep"):
            trial_config(run, trusted=frozenset({"my.own.model"}))
    finally:
        sys.path.remove(str(tmp_path))
    assert not marker.exists()


def evidence_sweep(sweep_dir: Path, *extra: str) -> list[str]:
    """An evidence sweep whose bf16 cell is open at its first look (an accuracy cell is judged
    from 3 seeds) and decided at its second: L = 2 looks, 6 jobs."""
    return [
        "-m",
        "hydra/sweeper=evidence",
        "precision=fp32,bf16",
        "evidence.max_seeds=3",
        "report.tolerance=50",
        *SWEEP,
        f"hydra.sweep.dir={sweep_dir}",
        *extra,
    ]


def outcome(sweep_dir: Path) -> dict:
    """What an evidence sweep decided: its looks and seeds, and each comparison's verdict, delta,
    interval and seeds (timings aside)."""
    evidence = json.loads((sweep_dir / EVIDENCE_JSON).read_text())
    report = json.loads((sweep_dir / "report.json").read_text())
    keys = ("model", "label", "verdict", "n_attempted", "delta", "ci_low", "ci_high")
    return {
        "looks": evidence["looks"],
        "seeds": evidence["seeds"],
        "jobs": evidence["jobs"],
        "comparisons": [{k: c.get(k) for k in keys} for c in report["comparisons"]],
    }


@pytest.mark.slow
@pytest.mark.usefixtures("pngs_not_rasterized")  # read for its words (conftest)
def test_an_evidence_sweep_killed_in_its_second_look_resumes_to_the_same_answer(
    tmp_path: Path, monkeypatch, amp_exp_here
) -> None:
    """SIGKILL while the second look's first job trains, then ``resume=auto``: the killed job
    runs again, evidence.json keeps both looks, and the looks, seeds, verdicts, deltas and
    intervals equal an uninterrupted sweep's. A canary planted in a job's overrides.yaml, which
    the resume relaunches, is never imported: a job's overrides come from the command line.
    The sweep that is killed has a process of its own; the others run through the entry point
    in this process, with the canary's folder on the path as ``amp_exp`` puts it."""
    marker = plant_canary(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    done = amp_exp_here(*evidence_sweep(whole))
    assert done.returncode == 0, done.stderr[-3000:]
    expected = outcome(whole)
    assert [look["mlp||bf16"]["n"] for look in expected["looks"]] == [2, 3]

    sweep = start_python_m(
        "amp_exp", *evidence_sweep(killed), env=with_canary(tmp_path), start_new_session=True
    )
    second_look = killed / "4" / ".hydra" / "overrides.yaml"
    deadline = time.monotonic() + 240
    # Written, not only created: the canary is planted among the overrides it holds.
    while not (second_look.exists() and second_look.stat().st_size) and sweep.poll() is None:
        assert time.monotonic() < deadline, "the sweep never reached its second look"
        time.sleep(0.02)
    os.killpg(sweep.pid, signal.SIGKILL)
    sweep.wait()
    assert not (killed / "4" / "summary.json").exists(), "the kill came after the job ended"
    overrides = killed / "4" / ".hydra" / "overrides.yaml"
    planted = [*yaml.safe_load(overrides.read_text()), f"+precision._target_={CANARY}"]
    overrides.write_text(yaml.safe_dump(planted))

    result = amp_exp_here(*evidence_sweep(killed, "resume=auto"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert outcome(killed) == expected
    assert json.loads((killed / "4" / "summary.json").read_text())["status"] == "completed"
    assert not marker.exists()


def files_of(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


@pytest.mark.slow
@pytest.mark.usefixtures("pngs_not_rasterized")  # read for its words (conftest)
def test_a_sweep_resumed_with_its_values_reordered_finds_each_jobs_own_directory(
    tmp_path: Path, monkeypatch, amp_exp_here
) -> None:
    """``precision=fp32,bf16``, the bf16 job then lost (its summary gone, as if killed), then
    ``precision=bf16,fp32 resume=auto``: Hydra numbers bf16 job 0, yet it runs in its own
    directory (1), and the completed fp32 job is not launched again, its files untouched. The
    same sweep with another learning rate holds another experiment: refused, nothing written."""
    sweep = tmp_path / "sweep"
    where = f"hydra.sweep.dir={sweep}"
    # The sweeps through the entry point in this process (a fresh one costs seconds to start).
    monkeypatch.syspath_prepend(str(tmp_path))
    done = amp_exp_here("-m", *SWEEP, where, "precision=fp32,bf16")
    assert done.returncode == 0, done.stderr[-3000:]
    (sweep / "1" / "summary.json").unlink()
    fp32_job = files_of(sweep / "0")

    result = amp_exp_here("-m", *SWEEP, where, "precision=bf16,fp32", "resume=auto")
    assert result.returncode == 0, result.stderr[-3000:]
    assert files_of(sweep / "0") == fp32_job
    summary = json.loads((sweep / "1" / "summary.json").read_text())
    assert (summary["precision"], summary["status"]) == ("bf16", "completed")
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0", "1"]

    before = files_of(sweep)
    args = ["-m", *SWEEP, where, "precision=bf16,fp32", "resume=auto", "optimizer.lr=0.5"]
    (line,) = refused_before_hydra(amp_exp_here, monkeypatch, tmp_path, *args).strip().splitlines()
    assert "job 0 holds an experiment this sweep does not plan (optimizer.lr: 0.1 -> 0.5)" in line
    assert files_of(sweep) == before


def test_a_raised_max_seeds_on_resume_is_one_line_and_writes_nothing(
    tmp_path: Path, monkeypatch, amp_exp_here
) -> None:
    """The looks planned set every look's level: a resume asking for more seeds is refused
    before Hydra starts (before it would rewrite multirun.yaml), exit 2, one line."""
    sweep = tmp_path / "sweep"
    write_json(sweep / EVIDENCE_JSON, {"plan": {"min_seeds": 2, "max_seeds": 3, "looks": 2}})
    before = files_of(sweep)
    args = [*evidence_sweep(sweep, "resume=auto"), "evidence.max_seeds=4"]
    (line,) = refused_before_hydra(amp_exp_here, monkeypatch, tmp_path, *args).strip().splitlines()
    assert line.startswith("amp_exp: error: evidence.min_seeds=2 evidence.max_seeds=4: this sweep")
    assert files_of(sweep) == before and sorted(os.listdir(sweep)) == [EVIDENCE_JSON]


# --- what a resume may change -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "old", "new"),
    [
        ("clip_grad_norm", None, 1.0),
        ("init_scale", 65536.0, 1024.0),
        ("growth_interval", 2000, 10),
        ("keep_fp32", [], ["head"]),
        ("options", {"hadamard_wgrad": True}, {"hadamard_wgrad": False}),
        ("_target_", None, "my.Plugin"),
    ],
)
def test_a_precision_option_cannot_change_on_resume(key, old, new) -> None:
    """Precision options are what is trained: a change to one is refused with both values."""
    saved = {"precision": {"name": "fp16", key: old}}
    refused, allowed = config_changes(saved, {"precision": {"name": "fp16", key: new}})
    assert refused and refused[0].startswith(f"precision.{key}") and not allowed


def test_what_may_change_is_one_list_and_the_rest_is_refused() -> None:
    """The step count, logging, W&B, where the data lives, the other commands' sections and the
    precision within its family may change; the trainer's numerics may not."""
    saved = {
        "resume": None,
        "trainer": {"max_steps": 4, "log_every": 2, "tf32": True, "on_nonfinite": "skip"},
        "wandb": {"mode": "offline"},
        "evidence": {"max_seeds": 5},
        "dataset": {"root": "a", "batch_size": 16},
        "precision": {"name": "fp16"},
    }
    current = {
        "resume": "auto",
        "trainer": {"max_steps": 8, "log_every": 4, "tf32": False, "on_nonfinite": "off"},
        "wandb": {"mode": "online"},
        "evidence": {"max_seeds": 3},
        "dataset": {"root": "b", "batch_size": 16},
        "precision": {"name": "bf16"},
    }
    refused, allowed = config_changes(saved, current)
    assert refused == ['trainer.on_nonfinite: "skip" -> "off"', "trainer.tf32: true -> false"]
    assert [change.split(":")[0] for change in allowed] == [
        "dataset.root",
        "evidence.max_seeds",
        "precision.name",
        "trainer.log_every",
        "trainer.max_steps",
        "wandb.mode",
    ]
    # A sweep's job is what it trains: its precision and seed, never its launch flags.
    assert trained_values(saved) == {
        "trainer.tf32": True,
        "trainer.on_nonfinite": "skip",
        "dataset.batch_size": 16,
        "precision.name": "fp16",
    }


def test_a_changed_clip_grad_norm_is_refused_before_anything_is_loaded(run_cfg, tmp_path) -> None:
    """precision.clip_grad_norm null -> 1.0 on resume=auto used to continue the run."""
    short = [*FAST, *TINY, "checkpoint.every_steps=2", "trainer.max_steps=6"]
    train(run_cfg(*short), tmp_path)
    (tmp_path / "summary.json").unlink()
    with pytest.raises(RunRefused, match=r"precision.clip_grad_norm: null -> 1.0"):
        train(run_cfg(*short, "resume=auto", "precision.clip_grad_norm=1.0"), tmp_path)


@pytest.mark.parametrize("name", ["cosine", "onecycle"])
def test_a_longer_resume_keeps_the_schedules_horizon(name: str) -> None:
    """A 10-step schedule resumed as a 14-step one: its first 10 rates are those of the 10-step
    run (the horizon comes from the checkpoint, not from trainer.max_steps now), and it holds its
    last rate after (onecycle used to raise past its end)."""

    def schedule(total: int):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        config = SchedulerConfig(name=SchedulerName(name), warmup_steps=2)
        return optimizer, build_scheduler(config, optimizer, total)

    def rates(optimizer, scheduler, steps: int) -> list[float]:
        found = []
        for _ in range(steps):
            optimizer.step()
            scheduler.step()
            found.append(optimizer.param_groups[0]["lr"])
        return found

    planned = rates(*schedule(10), 9)
    optimizer, scheduler = schedule(10)
    first = rates(optimizer, scheduler, 5)
    resumed_optimizer, resumed = schedule(14)
    resumed_optimizer.load_state_dict(optimizer.state_dict())
    resumed.load_state_dict(scheduler.state_dict())
    after = rates(resumed_optimizer, resumed, 9)
    assert first + after[:4] == pytest.approx(planned)
    assert after[4:] == pytest.approx([after[4]] * 5)
