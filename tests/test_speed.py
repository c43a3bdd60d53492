"""The interleaved speed trial: its interval holds what a per-step clock measures over the same
rounds, it times what training runs, and ``python -m amp_exp.speed`` writes its files."""

from __future__ import annotations

import atexit
import itertools
import json
import statistics
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import amp_exp.speed.trial as trial_module
from amp_exp.config.schema import Precision, ReportConfig
from amp_exp.errors import ConfigError
from amp_exp.report.callback import SweepReport
from amp_exp.results.files import SPEED_JSON, SPEED_MD
from amp_exp.speed.__main__ import candidates
from amp_exp.training.meters import synchronize
from amp_exp.training.timing import interleave
from helpers.runs import TINY
from helpers.warm_python import python_m
from test_report import write_run

# Long enough steps that the clock's resolution and Python's overhead are small beside them.
TRIAL = [*TINY, "model.width=16", "dataset.image_size=16", "dataset.batch_size=32"]


def test_interleave_runs_candidates_in_turns_after_their_warm_up() -> None:
    calls = []
    seconds = interleave(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
        device=__import__("torch").device("cpu"),
        steps=2,
        rounds=3,
        warmup_steps=1,
    )
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 3
    assert [[len(steps) for steps in rounds] for rounds in seconds.values()] == [[2] * 3] * 2


def test_the_trials_interval_holds_the_ratio_a_per_step_clock_measures_over_its_rounds(
    run_cfg, monkeypatch
) -> None:
    """scripts/bench_parity.py's clock: a synchronized stamp at every optimizer step, and the
    ratio of the sides' median step times, read in each of the very rounds the trial times: the
    same machine load is behind both, measured by another clock. (Pooled over all rounds,
    medians would mix loaded and idle rounds: the trial pairs rounds to avoid exactly that.)"""
    stamps: dict[str, list[float]] = {}

    def build_with_a_clock(cfg):
        built = real_build(cfg)
        label = cfg.precision.name.value
        stamps[label] = []

        def stamp(*_: object) -> None:
            synchronize(built.device)
            stamps[label].append(time.perf_counter())

        built.engine.optimizer.register_step_post_hook(stamp)
        return built

    real_build = trial_module.build
    monkeypatch.setattr(trial_module, "build", build_with_a_clock)
    cfg = run_cfg(*TRIAL, "speed.rounds=8", "speed.steps=6", "speed.warmup_steps=2")
    configs = {p: c for p, c in candidates(cfg).items() if p in ("fp32", "bf16")}
    result = trial_module.run_trial(configs, cfg.speed)
    steps, warmup = cfg.speed.steps, cfg.speed.warmup_steps

    def median_steps(label: str) -> list[float]:
        """Each round's median step time; a round's first step starts after the other side's."""
        timed = stamps[label][warmup:]
        rounds = [timed[r * steps : (r + 1) * steps] for r in range(cfg.speed.rounds)]
        return [statistics.median(b - a for a, b in itertools.pairwise(run)) for run in rounds]

    assert [len(stamps[p]) for p in ("fp32", "bf16")] == [warmup + steps * 8] * 2
    measured = statistics.median(
        f / b for f, b in zip(median_steps("fp32"), median_steps("bf16"), strict=True)
    )
    low, high = result["speedup"]["bf16"]["ci95"]
    assert low <= measured <= high, (measured, result["speedup"]["bf16"])
    assert result["ms_per_step"]["fp32"] and len(result["ms_per_step"]["bf16"]) == 8


def test_the_trial_asks_for_enough_rounds_and_real_precisions(run_cfg) -> None:
    with pytest.raises(ConfigError, match=r"speed.rounds=5 must be 6 or more"):
        run_cfg("speed.rounds=5")
    with pytest.raises(ConfigError, match=r"speed.precisions must list precisions to time"):
        run_cfg("speed.precisions=[auto]")
    configs = candidates(run_cfg("speed.precisions=[bf16,fp16]"))
    assert list(configs) == ["fp32", "bf16", "fp16"]
    assert configs["bf16"].precision.name is Precision.bf16


@pytest.mark.slow
def test_python_m_amp_exp_speed_writes_speed_json_and_speed_md(tmp_path: Path) -> None:
    result = python_m(
        "amp_exp.speed",
        *TRIAL,
        "trainer.device=cpu",
        "dataset.num_workers=0",
        "speed.precisions=[fp32,bf16]",
        "speed.rounds=6",
        "speed.steps=2",
        f"hydra.run.dir={tmp_path}",
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (trial,) = json.loads((tmp_path / SPEED_JSON).read_text())["trials"]
    assert trial["model"] == "tiny_cnn" and trial["rounds"] == 6
    assert list(trial["ms_per_step"]) == ["fp32", "bf16"]
    bf16 = trial["speedup"]["bf16"]
    assert bf16["ci95"][0] <= bf16["median"] <= bf16["ci95"][1]
    assert "| bf16 |" in (tmp_path / SPEED_MD).read_text()
    assert "bf16: " in result.stdout and "fp32's speed (95% CI" in result.stdout
    assert not (tmp_path / ".hydra").exists()  # a report must not take it for a killed run


@pytest.mark.slow
def test_python_m_amp_exp_speed_refuses_a_sweep_in_one_line(tmp_path: Path) -> None:
    result = python_m("amp_exp.speed", "-m", "precision=fp32,bf16", timeout=120, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "amp_exp.speed: error: python -m amp_exp.speed times its precisions in one process: "
        "list them in speed.precisions=[...] instead of sweeping with -m"
    ]


def sweep_start(callback: SweepReport, sweep_dir: Path, launcher: str) -> None:
    config = OmegaConf.create(
        {
            "hydra": {"sweep": {"dir": str(sweep_dir)}, "launcher": {"_target_": launcher}},
            "report": OmegaConf.structured(ReportConfig),
        }
    )
    callback.on_multirun_start(config)
    atexit.unregister(callback.build)


def test_a_sweeps_trial_that_fails_never_costs_its_report(tmp_path: Path, caplog) -> None:
    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.8)

    def failing_trial(sweep_dir: Path) -> None:
        raise RuntimeError("out of memory")

    callback = SweepReport(speed_trial=failing_trial)
    sweep_start(callback, tmp_path, "hydra._internal.core_plugins.basic_launcher.BasicLauncher")
    callback.build()
    assert "no speed trial: out of memory" in caplog.messages
    assert (tmp_path / "report.md").is_file()


def test_under_slurm_the_sweeps_own_process_times_nothing(tmp_path: Path) -> None:
    """It runs where the sweep was submitted, not on the nodes that trained."""
    trials: list[Path] = []
    callback = SweepReport(speed_trial=trials.append)
    sweep_start(callback, tmp_path, "hydra_plugins._amp_exp_submitit.SlurmLauncher")
    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.8)
    callback.build()
    assert trials == [] and (tmp_path / "report.md").is_file()
    sweep_start(callback, tmp_path, "hydra_plugins._amp_exp_submitit.LocalLauncher")
    callback.build()
    assert trials == [tmp_path]
