"""The speed trial: pairs timed AB, BA, ... with no more than two runs alive, warmed up until
steady, a t interval on log ratios that covers 95%, skipped steps counted, a stand-in for a
torchrun job kept out of the verdicts, and ``python -m amp_exp.speed`` writes its files."""

from __future__ import annotations

import atexit
import json
import math
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

import amp_exp.capability.rounds as rounds_module
import amp_exp.speed.trial as trial_module
from amp_exp.capability.ratio import speedup
from amp_exp.config.adaptive import SpeedStopping
from amp_exp.config.schema import ReportConfig
from amp_exp.errors import ConfigError
from amp_exp.report.assemble import SweepReport, build_report
from amp_exp.report.evidence import trial_speedup
from amp_exp.results.files import SPEED_JSON, SPEED_MD
from amp_exp.speed.__main__ import candidates
from amp_exp.speed.sweep import stand_in
from test_report import write_run

# Long enough steps that the clock's resolution and Python's overhead are small beside them: an
# MLP, as bf16 convolutions on the CPU take a tenth of a second a step.
TRIAL = ["model=mlp", "dataset.image_size=16", "dataset.batch_size=32"]


def test_rounds_alternate_ab_and_ba_so_each_side_leads_in_half() -> None:
    orders = rounds_module.round_orders("bf16", 6)
    assert orders[:2] == [("fp32", "bf16"), ("bf16", "fp32")]
    assert [order[0] for order in orders].count("fp32") == 3 and len(set(orders[2:])) == 2


def test_every_round_logs_the_running_ratio_and_from_four_rounds_its_interval(caplog) -> None:
    """Caught: a trial of minutes silent until its end, or a progress line whose figure is not
    the trial's own (capability/ratio.py's interval of the rounds so far)."""
    times = iter([1.0, 0.5, 0.52, 1.02, 1.01, 0.49, 0.5, 0.98, 1.0, 0.51, 0.5, 1.0] * 2)

    class Clock:
        def __init__(self, device) -> None: ...

        def start(self) -> None: ...

        def lap(self) -> None: ...

        def seconds(self) -> list[float]:
            return [next(times)]

    sides = {"fp32": rounds_module.Side(lambda: None), "bf16": rounds_module.Side(lambda: None)}
    stopping = SpeedStopping(rounds=6, max_rounds=6)
    with pytest.MonkeyPatch.context() as patch, caplog.at_level("INFO", logger="amp_exp"):
        patch.setattr(rounds_module, "StepClock", Clock)
        patch.setattr(rounds_module, "PROGRESS_EVERY_S", 0.0)  # as if each round took long
        patch.setattr(rounds_module, "warm_up", lambda step, device, steps: (0, True))
        orders, _, stopped = rounds_module.play(sides, "bf16", torch.device("cpu"), stopping, 1, 0)
    lines = [r.message for r in caplog.records if r.message.startswith("speed bf16 vs fp32")]
    assert len(orders) == 6 and stopped is None and len(lines) == 6
    assert lines[0] == "speed bf16 vs fp32, round 1/6: 2.00x so far (no interval before 4 rounds)"
    found = rounds_module.pair_speedup(sides, "bf16").as_dict()
    low, high = found["ci"]
    assert lines[-1] == (
        f"speed bf16 vs fp32, round 6/6: {found['ratio']:.2f}x [{low:.2f}, {high:.2f}] so far"
    )


def test_a_skipped_step_costs_its_time_and_counts_as_no_progress() -> None:
    side = rounds_module.Side(step=None, seconds=[[1.0, 1.0, 1.0, 5.0]], skipped=[2])
    assert side.per_applied_step() == [2.0]  # median 1 s x 4 steps / 2 applied, not 1.0
    assert side.total_per_applied_step() == 4.0  # 8 s of wall clock over 2 applied steps
    side.skipped = [4]
    assert side.per_applied_step() == [math.inf]


def test_the_interval_is_on_log_ratios_so_swapping_the_sides_inverts_it() -> None:
    """An interval on the ratios themselves is not reciprocal when the sides swap (coverage under
    autocorrelated rounds: tests/test_speed_interval.py)."""
    fp32, bf16 = [10.0, 11.0, 30.0, 10.2, 10.8, 10.1], [5.0, 5.4, 5.1, 5.2, 5.3, 5.0]
    forward, backward = speedup(fp32, bf16, 2.0), speedup(bf16, fp32, 0.5)
    assert forward.ratio == pytest.approx(1 / backward.ratio)
    assert forward.ci == pytest.approx((1 / backward.ci[1], 1 / backward.ci[0]))
    with pytest.raises(ValueError, match="the clock measured no spread"):
        speedup([2.0] * 6, [1.0] * 6, 2.0)


def test_a_drift_over_rounds_is_flagged_and_alternating_noise_is_not() -> None:
    drifting = speedup([1.0 + 0.1 * r for r in range(10)], [1.0] * 10, 1.4)
    assert drifting.trend and drifting.trend_rho == pytest.approx(1.0)
    alternating = speedup(
        [1.1, 1.0, 1.12, 1.01, 1.09, 0.99, 1.11, 1.0, 1.1, 1.02], [1.0] * 10, 1.05
    )
    assert not alternating.trend


def test_each_pair_runs_in_its_recorded_order_and_no_more_than_two_runs_are_alive(
    run_cfg, monkeypatch
) -> None:
    """Every training step of every engine stamps its side: the stamps after the warm-ups must
    follow speed.json's order, and at each build at most one other engine may still be alive
    (the trial held every precision's engine at once before)."""
    stamps: list[str] = []
    alive: list[weakref.ref] = []
    alive_at_build: list[int] = []

    def build_and_watch(cfg):
        alive_at_build.append(sum(ref() is not None for ref in alive))
        built = real_build(cfg)
        label = cfg.precision.name
        train_step = built.engine.train_step

        def stamped(*args: object, **kwargs: object) -> object:
            stamps.append(label)
            return train_step(*args, **kwargs)

        built.engine.train_step = stamped
        alive.append(weakref.ref(built.engine))
        return built

    real_build = trial_module.build
    monkeypatch.setattr(trial_module, "build", build_and_watch)
    # An MLP: the order of the steps is the point, and bf16 convolutions on the CPU take a
    # tenth of a second a step.
    cfg = run_cfg(
        "model=mlp",
        "model.hidden_dim=16",
        "dataset.image_size=8",
        "dataset.batch_size=4",
        "speed.precisions=[bf16,bf16_true]",
        "speed.rounds=6",
        "speed.max_rounds=6",
        "speed.steps=2",
        "speed.max_warmup_steps=10",
    )
    result = trial_module.run_trial(candidates(cfg), cfg.speed)
    assert alive_at_build == [0, 1, 0, 1] and not any(ref() for ref in alive)
    offset = 0
    for label in ("bf16", "bf16_true"):
        pair = result["pairs"][label]
        assert pair["order"] == [list(order) for order in rounds_module.round_orders(label, 6)]
        # fp32 warmed up, then the candidate, then the rounds.
        warm = pair["warmup_steps"]
        expected = ["fp32"] * warm["fp32"] + [label] * warm[label]
        expected += [side for order in pair["order"] for side in order for _ in range(2)]
        assert stamps[offset : offset + len(expected)] == expected
        offset += len(expected)
        assert len(pair["ms_per_step"][label]) == 6 and pair["skipped_steps"][label] == 0
    assert offset == len(stamps)
    assert set(result["speedup"]) == {"bf16", "bf16_true"}


def test_a_torchrun_sweeps_single_process_trial_is_labelled_and_kept_out_of_verdicts() -> None:
    jobs = {"fp32": SimpleNamespace(summary={"world_size": 2, "strategy": "ddp"})}
    assert stand_in(jobs) == "single-process stand-in for ddp on 2 ranks"
    assert stand_in({"fp32": SimpleNamespace(summary={"world_size": 1})}) is None
    found = {"ratio": 1.2, "ci95": [1.1, 1.3], "rounds": 10}
    trial = {"model": "tiny_cnn", "setting": "", "speedup": {"bf16": found}}
    assert trial_speedup([trial], ("tiny_cnn", "", "bf16")) == found
    labelled = {**trial, "stand_in": stand_in(jobs)}
    assert trial_speedup([labelled], ("tiny_cnn", "", "bf16")) is None


def test_the_trial_asks_for_an_even_number_of_rounds_a_warm_up_cap_and_real_precisions(
    run_cfg,
) -> None:
    with pytest.raises(ConfigError, match=r"speed.rounds=5 must be even and 6 or more"):
        run_cfg("speed.rounds=5")
    with pytest.raises(ConfigError, match=r"speed.rounds=7 must be even"):
        run_cfg("speed.rounds=7")
    with pytest.raises(ConfigError, match=r"speed.max_warmup_steps=9 must be 10 or more"):
        run_cfg("speed.max_warmup_steps=9")
    with pytest.raises(ConfigError, match=r"speed.precisions must list precisions to time"):
        run_cfg("speed.precisions=[auto]")
    configs = candidates(run_cfg("speed.precisions=[bf16,fp16]"))
    assert list(configs) == ["fp32", "bf16", "fp16"]
    assert configs["bf16"].precision.name == "bf16"


@pytest.mark.slow
def test_python_m_amp_exp_speed_writes_speed_json_and_speed_md(
    tmp_path: Path, command_main
) -> None:
    """Through the command's entry point in this process: what ``python -m amp_exp.speed``
    writes and prints is checked, not how a process ends."""
    result = command_main(
        "amp_exp.speed",
        *TRIAL,
        "trainer.device=cpu",
        "dataset.num_workers=0",
        "speed.precisions=[fp32,bf16]",
        "speed.rounds=6",
        "speed.max_rounds=6",
        "speed.steps=2",
        "speed.max_warmup_steps=10",
        f"hydra.run.dir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (trial,) = json.loads((tmp_path / SPEED_JSON).read_text())["trials"]
    assert trial["model"] == "mlp" and trial["rounds"] == 6
    pair = trial["pairs"]["bf16"]
    assert pair["order"][:2] == [["fp32", "bf16"], ["bf16", "fp32"]]
    assert set(pair["warmup_steps"]) == {"fp32", "bf16"} and set(trial["speedup"]) == {"bf16"}
    assert "| bf16 |" in (tmp_path / SPEED_MD).read_text()
    assert "bf16: " in result.stdout and "fp32's speed over 6 rounds" in result.stdout
    assert not (tmp_path / ".hydra").exists()  # a report must not take it for a killed run


@pytest.mark.slow
def test_python_m_amp_exp_speed_refuses_a_sweep_in_one_line(
    tmp_path: Path, command_main, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)  # where a sweep it did not refuse would write
    result = command_main("amp_exp.speed", "-m", "precision=fp32,bf16")
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
    atexit.unregister(callback.build_at_exit)


def test_a_sweeps_trial_that_fails_never_costs_its_report(tmp_path: Path, caplog) -> None:
    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.8)

    def failing_trial(sweep_dir: Path, trusted: frozenset[str]) -> None:
        raise RuntimeError("out of memory")

    callback = SweepReport(speed_trial=failing_trial)
    sweep_start(callback, tmp_path, "hydra._internal.core_plugins.basic_launcher.BasicLauncher")
    callback.build()
    assert "no speed trial: out of memory" in caplog.messages
    assert (tmp_path / "report.md").is_file()


def test_under_slurm_the_sweeps_own_process_times_nothing(tmp_path: Path) -> None:
    """It runs where the sweep was submitted, not on the nodes that trained."""
    trials: list[Path] = []
    callback = SweepReport(speed_trial=lambda sweep_dir, trusted: trials.append(sweep_dir))
    sweep_start(callback, tmp_path, "hydra_plugins._amp_exp_submitit.SlurmLauncher")
    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.8)
    callback.build()
    assert trials == [] and (tmp_path / "report.md").is_file()
    sweep_start(callback, tmp_path, "hydra_plugins._amp_exp_submitit.LocalLauncher")
    callback.build()
    assert trials == [tmp_path]


def test_a_report_with_a_trial_gives_no_probe_advice_for_the_same_precision(
    tmp_path: Path,
) -> None:
    """A verdict said 0.67x fp32's speed while each bf16 job's AMP-health line said "1.20x
    slower": one speed fact per model and precision."""
    advice = "the probe's conv kernels ran fp16 about 22x slower than fp32 here: use precision=fp32"
    for model in ("tiny_cnn", "mlp"):
        write_run(tmp_path / model / "0", model, "fp32", 1000.0, 0.8)
        fp16 = tmp_path / model / "1"
        write_run(fp16, model, "fp16", 900.0, 0.8)
        summary = json.loads((fp16 / "summary.json").read_text())
        summary["hardware"] = {"advice": [advice]}
        (fp16 / "summary.json").write_text(json.dumps(summary))
    # A speed.json from before the trial looked: its one interval is a 95% one.
    found = {"ratio": 1.1, "ci95": [1.05, 1.15], "rounds": 10, "total_time_ratio": 1.1}
    speed = {"trials": [{"model": "tiny_cnn", "setting": "", "speedup": {"fp16": found}}]}
    (tmp_path / SPEED_JSON).write_text(json.dumps(speed))
    report = build_report([tmp_path], tmp_path)
    health = {row["model"]: row["health"]["hardware_advice"] for row in report["runs"]}
    assert health == {"tiny_cnn": [], "mlp": [advice]}  # mlp had no trial: the probe's stands
    (cnn,) = [line for line in report["verdicts"] if line.startswith("tiny_cnn")]
    assert "1.10x fp32's speed (95% CI" in cnn
    markdown = (tmp_path / "report.md").read_text()
    assert markdown.count(advice) == 1 and "(mlp fp16): checks passed; " in markdown


def test_speed_md_labels_a_stand_in_and_flags_a_trend() -> None:
    found = speedup([1.0 + 0.1 * r for r in range(6)], [1.0] * 6, 1.2).as_dict()
    pair = {
        "ms_per_applied_step": {"fp32": 12.0, "bf16": 10.0},
        "warmup_steps": {"fp32": 10, "bf16": 35},
        "steady": {"fp32": True, "bf16": False},
        "skipped_steps": {"fp32": 0, "bf16": 0},
    }
    trial = {
        "model": "gpt_tiny",
        "stand_in": "single-process stand-in for ddp on 2 ranks",
        "device_name": "test cpu",
        "samples_per_step": 8,
        "max_warmup_steps": 100,
        "warmup_level": 0.05,
        "rounds": 6,
        "max_rounds": 6,
        "target_halfwidth": 0.0488,
        "steps": 5,
        "pairs": {"bf16": pair},
        "speedup": {"bf16": found},
        "not_timed": {},
    }
    markdown = trial_module.trial_markdown([trial])
    assert "A single-process stand-in for ddp on 2 ranks: shown here, kept out of" in markdown
    assert "| bf16 | 12 / 10 | 1.24x [" in markdown and "TREND over rounds" in markdown
    assert "| 10 / 35 (not steady: bf16) |" in markdown
    assert "no trend (Mann-Kendall, not rejected at 5%; at most 100 steps)" in markdown
