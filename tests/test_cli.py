"""End to end: ``python -m amp_exp`` as a user runs it, results read back from disk. The runs go
through the command's entry point in this process (what a process of their own adds, its exit
status, is test_console_script_is_installed's)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.runs import FAST, read_jsonl

pytestmark = pytest.mark.slow

TRAIN_KEYS = {
    "step",
    "loss",
    "lr",
    "grad_norm",
    "scale",
    "skipped_steps",
    "samples_per_s",
    "step_time_ms",
    "peak_mem_bytes",
}
SUMMARY_KEYS = {
    "precision",
    "precision_reason",
    "model",
    "dataset",
    "device",
    "steps",
    "samples_per_s",
    "peak_mem_bytes",
    "final_loss",
    "eval_acc",
    "loss_scale",
    "skipped_steps",
    "wall_s",
    "torch_version",
    "git_sha",
}


@pytest.fixture
def run_here(amp_exp_here):
    """``run_here(*args)``: ``python -m amp_exp args`` through its entry point in this process;
    fails the test unless it exits 0."""

    def run(*args: str) -> subprocess.CompletedProcess:
        result = amp_exp_here(*args)
        assert result.returncode == 0, result.stderr[-3000:]
        return result

    return run


def test_run_writes_metrics_summary_config_and_log(tmp_path: Path, run_here) -> None:
    run_here(
        *FAST,
        "precision=bf16",
        "model.width=4",  # bf16 convolutions take a tenth of a second a CPU step at width 32
        "trainer.max_steps=6",
        "trainer.timing_warmup_steps=2",
        f"hydra.run.dir={tmp_path}",
    )
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [2, 4, 6]
    assert all(r.keys() >= TRAIN_KEYS for r in train_rows)
    assert all(r["scale"] is None and r["skipped_steps"] == 0 for r in train_rows)
    assert train_rows[0]["samples_per_s"] is None  # steps 1-2 are warm-up
    assert all(r["samples_per_s"] > 0 for r in train_rows[1:])
    eval_rows = [r for r in rows if "eval_acc" in r]
    assert [r["step"] for r in eval_rows] == [6]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary.keys() >= SUMMARY_KEYS
    identity = (summary["precision"], summary["model"], summary["device"])
    assert identity == ("bf16", "tiny_cnn", "cpu")
    assert summary["final_loss"] == train_rows[-1]["loss"]
    assert summary["eval_acc"] == eval_rows[-1]["eval_acc"]
    assert "precision=bf16" in summary["precision_reason"]
    assert (tmp_path / ".hydra" / "config.yaml").exists()
    log = (tmp_path / "train.log").read_text()
    assert "[####################] 6/6" in log


def test_fp16_run_logs_the_loss_scale(tmp_path: Path, run_here) -> None:
    run_here(
        *FAST,
        "precision=fp16",
        "model.width=4",
        "dataset.image_size=8",
        "precision.init_scale=1024",
        f"hydra.run.dir={tmp_path}",
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["precision"] == "fp16" and summary["loss_scale"] == 1024.0
    scales = [r["scale"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert scales == [1024.0] * 2


def test_console_script_is_installed() -> None:
    script = shutil.which("amp-exp") or str(Path(sys.executable).parent / "amp-exp")
    result = subprocess.run([script, "precision=fp4"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "valid choices: auto, bf16, bf16_true, bf16_true_nearest, fp16, fp32, fp8" in (
        result.stderr
    )


HELP_COMMANDS = [
    "amp_exp",
    "amp_exp.report",
    "amp_exp.speed",
    "amp_exp.sensitivity",
    "amp_exp.doctor",
    "amp_exp.predict",
    "amp_exp.forecast",
]


@pytest.mark.parametrize("command", HELP_COMMANDS)
def test_every_command_has_help_of_one_shape_without_markup_schema_groups_or_module_names(
    command: str, command_main
) -> None:
    """Issue 37: --help began "train is powered by Hydra", listed schema/* groups and dumped
    154 lines of config; .doctor's showed backticks and module names."""
    result = command_main(command, "--help")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert len(lines) <= 80
    assert lines[0].startswith(f"python -m {command}: ")
    assert f"Usage: python -m {command} " in result.stdout
    assert "Other commands:" in result.stdout and "Docs: README.md" in result.stdout
    assert all(
        f"python -m {other} " in result.stdout for other in HELP_COMMANDS if other != command
    )
    for internal in ("schema/", "`", "powered by Hydra", "runtime.", "training.", "_target_"):
        assert internal not in result.stdout


def test_the_training_help_lists_every_option_of_every_group_a_user_picks_from(
    command_main,
) -> None:
    from amp_exp.config.help import CONF_DIR, GROUPS

    text = " ".join(command_main("amp_exp", "--help").stdout.split())
    # A group with a choice to make (more than its default) is listed: a new one cannot hide.
    chosen = {d.name for d in CONF_DIR.iterdir() if d.is_dir() and len(list(d.glob("*.yaml"))) > 1}
    assert chosen == set(GROUPS)
    for group in GROUPS:
        names = sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))
        assert ", ".join(names) in text
    assert "--cfg job" in text


def test_a_language_model_alone_trains_on_tokens_and_says_so_in_one_line(
    tmp_path: Path, run_here
) -> None:
    """Issue 37: model=gpt_tiny alone failed, the dataset defaulting to images."""
    tokens = ["dataset.train_size=64", "dataset.eval_size=16", "model.d_model=16"]
    result = run_here("model=gpt_tiny", *FAST[:5], *tokens, f"hydra.run.dir={tmp_path}")
    note = "amp_exp: dataset=synthetic_tokens: the default for model=gpt_tiny, a language model"
    assert result.stderr.count(note) == 1
    assert json.loads((tmp_path / "summary.json").read_text())["dataset"] == "synthetic_tokens"
    # Named, the dataset is the user's, and nothing is said.
    named = run_here(
        "model=gpt_tiny",
        "dataset=synthetic_tokens",
        *FAST[:5],
        *tokens,
        f"hydra.run.dir={tmp_path / 'named'}",
    )
    assert "the default for model=" not in named.stderr
