"""A run directory belongs to one run, and a finished result is never lost or overwritten."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from amp_exp.errors import NumericalFault, RunRefused, RuntimeFault
from amp_exp.results.lock import RunDirectoryBusy, RunDirectoryLock
from amp_exp.results.resume_rules import config_changes
from amp_exp.results.summary import record_failure
from amp_exp.run import train
from helpers.runs import FAST, TINY, read_jsonl, signal_self_at_call
from helpers.warm_python import python_m

# 256 samples / batch 16: 16 batches an epoch.
SHORT = [*TINY, "trainer.max_steps=4", "trainer.log_every=2"]


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def amp_exp_cli(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return python_m("amp_exp", *FAST, *overrides, f"hydra.run.dir={run_dir}", timeout=300)


def test_a_second_process_is_refused_while_the_first_holds_the_directory(tmp_path) -> None:
    holder = f"pid {os.getpid()} on {socket.gethostname()}"
    with RunDirectoryLock(tmp_path), pytest.raises(RunDirectoryBusy, match=holder):
        RunDirectoryLock(tmp_path).__enter__()
    with RunDirectoryLock(tmp_path):  # released on exit
        pass


def test_the_lock_dies_with_its_process(tmp_path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from amp_exp.results.lock import RunDirectoryLock; "
            f"lock = RunDirectoryLock(Path({str(tmp_path)!r})).__enter__(); "
            "print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(RunDirectoryBusy, match=f"pid {holder.pid}"):
        RunDirectoryLock(tmp_path).__enter__()
    holder.kill()  # SIGKILL: no handler runs, the OS drops the lock
    holder.wait()
    with RunDirectoryLock(tmp_path):
        pass


@pytest.mark.slow
def test_a_run_in_a_busy_directory_exits_2_in_one_line_and_touches_nothing(tmp_path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    before = snapshot(tmp_path)
    with RunDirectoryLock(tmp_path):
        result = amp_exp_cli(tmp_path, *SHORT)
    assert result.returncode == 2, result.stderr[-2000:]
    output = (result.stdout + result.stderr).splitlines()
    errors = [line for line in output if "error" in line.lower()]
    assert len(errors) == 1 and f"pid {os.getpid()}" in errors[0]
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith((".hydra", "train.log"))} == {
        **{k: v for k, v in before.items()},
        ".amp_exp.lock": after[".amp_exp.lock"],
    }


def test_resume_skips_a_torn_last_line_and_says_so(run_cfg, tmp_path, caplog) -> None:
    train(run_cfg(*SHORT, "checkpoint.every_steps=2"), tmp_path)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + "5}")  # a writer killed mid-line
    (tmp_path / "summary.json").unlink()  # as if killed before the end
    with caplog.at_level(logging.WARNING):
        summary = train(run_cfg(*SHORT, "resume=auto", "trainer.max_steps=6"), tmp_path)
    assert summary["status"] == "completed" and "unreadable line" in caplog.text
    assert [r["step"] for r in read_jsonl(metrics) if r["kind"] == "train"] == [2, 4, 6]


def test_resuming_a_completed_run_does_nothing_and_says_so(run_cfg, tmp_path, caplog) -> None:
    train(run_cfg(*SHORT), tmp_path)
    before = snapshot(tmp_path)
    with caplog.at_level(logging.INFO):
        summary = train(run_cfg(*SHORT, "resume=auto"), tmp_path)
    assert "completed at step 4; nothing to do" in caplog.text
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert snapshot(tmp_path) == {**before, ".amp_exp.lock": before[".amp_exp.lock"]}


def test_a_completed_run_can_be_extended(run_cfg, tmp_path) -> None:
    train(run_cfg(*SHORT), tmp_path)
    summary = train(run_cfg(*SHORT, "resume=auto", "trainer.max_steps=6"), tmp_path)
    assert (summary["status"], summary["steps"]) == ("completed", 6)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("seed=1", "seed: 0 -> 1"),
        ("dataset.batch_size=8", "dataset.batch_size: 16 -> 8"),
        ("model.width=8", "model.width: 4 -> 8"),
        ("optimizer=adamw", 'optimizer.name: "sgd" -> "adamw"'),
        ("trainer.grad_accum_steps=2", "trainer.grad_accum_steps: 1 -> 2"),
    ],
)
def test_resume_refuses_another_experiment_before_loading_anything(
    run_cfg, tmp_path, override, named
) -> None:
    train(run_cfg(*SHORT, "checkpoint.every_steps=2", "trainer.max_steps=6"), tmp_path)
    (tmp_path / "summary.json").unlink()
    before = snapshot(tmp_path)
    with pytest.raises(RunRefused, match="belongs to another experiment") as refused:
        train(run_cfg(*SHORT, "resume=auto", "trainer.max_steps=6", override), tmp_path)
    assert named in str(refused.value) and "\n" not in str(refused.value)
    assert snapshot(tmp_path) == before


def test_a_resume_past_its_new_last_step_is_refused_in_one_line(
    run_cfg, override_loss, tmp_path
) -> None:
    """A run stopped at step 6 cannot end at step 4: it would report 6 steps of 4, and no eval."""
    override_loss(signal_self_at_call(6))
    stopped = train(run_cfg(*SHORT, "trainer.max_steps=8"), tmp_path)
    assert (stopped["status"], stopped["steps"]) == ("stopped", 6)
    before = snapshot(tmp_path)
    with pytest.raises(RunRefused) as refused:
        train(run_cfg(*SHORT, "resume=auto", "trainer.max_steps=4"), tmp_path)
    assert str(refused.value) == (
        "resume=auto: the checkpoint is at step 6, past the 4 steps this run now trains; nothing "
        "was changed. Resume with trainer.max_steps=6 or more, or start a new run directory"
    )
    assert snapshot(tmp_path) == before
    resumed = train(run_cfg(*SHORT, "resume=auto", "trainer.max_steps=6"), tmp_path)
    assert (resumed["status"], resumed["steps"], resumed["total_steps"]) == ("completed", 6, 6)
    assert resumed["eval_acc"] is not None


def test_what_may_change_on_resume_is_allowed_and_listed() -> None:
    saved = {"trainer": {"max_steps": 4, "log_every": 2}, "wandb": {"mode": "offline"}}
    current = {"trainer": {"max_steps": 8, "log_every": 4}, "wandb": {"mode": "online"}}
    assert config_changes(saved, current) == (
        [],
        [
            "trainer.log_every: 2 -> 4",
            "trainer.max_steps: 4 -> 8",
            'wandb.mode: "offline" -> "online"',
        ],
    )
    # Autocast precisions share master weights: a change is allowed (with a warning on resume).
    assert config_changes({"precision": {"name": "fp16"}}, {"precision": {"name": "bf16"}})[0] == []


def test_a_failure_never_replaces_a_completed_summary(run_cfg, tmp_path) -> None:
    completed = train(run_cfg(*SHORT), tmp_path)
    error = NumericalFault("scale collapsed")
    written = record_failure(tmp_path, completed["config"], error, completed["task_metrics"])
    assert written.name == "summary.failed.json"
    assert json.loads((tmp_path / "summary.json").read_text()) == completed
    failed = json.loads(written.read_text())
    assert failed["status"] == "failed" and failed.keys() == completed.keys()


def test_a_corrupt_only_checkpoint_stops_resume_and_keeps_the_history(run_cfg, tmp_path) -> None:
    train(run_cfg(*SHORT, "checkpoint.every_steps=2", "checkpoint.keep=0"), tmp_path)
    (tmp_path / "checkpoints" / "last.pt").write_bytes(b"not a checkpoint")
    before = snapshot(tmp_path)
    with pytest.raises(RuntimeFault, match=r"no checkpoint in .* loads .*nothing was changed"):
        train(run_cfg(*SHORT, "resume=auto", "trainer.max_steps=6"), tmp_path)
    assert snapshot(tmp_path) == before


def test_temporaries_of_a_killed_save_are_swept_on_the_next_start(run_cfg, tmp_path) -> None:
    train(run_cfg(*SHORT, "checkpoint.every_steps=2"), tmp_path)
    stale = tmp_path / "checkpoints" / ".last.pt.k3j2.tmp"
    stale.write_bytes(b"half a checkpoint")
    train(run_cfg(*SHORT, "resume=auto", "trainer.max_steps=6"), tmp_path)
    assert not stale.exists()


def test_a_run_resumed_at_its_final_step_keeps_its_speed(run_cfg, tmp_path) -> None:
    first = train(run_cfg(*SHORT), tmp_path)
    (tmp_path / "summary.json").unlink()  # killed after the last checkpoint, before the summary
    again = train(run_cfg(*SHORT, "resume=auto"), tmp_path)
    assert again["steps"] == 4 and again["timed_steps"] == first["timed_steps"]
    assert again["samples_per_s"] == pytest.approx(first["samples_per_s"])


def test_result_files_and_checkpoints_get_the_umask_mode(run_cfg, tmp_path, umask) -> None:
    train(run_cfg(*SHORT), tmp_path)
    for name in ("summary.json", "metrics.jsonl", "checkpoints/last.pt"):
        mode = (tmp_path / name).stat().st_mode & 0o777
        assert mode == 0o666 & ~umask, name


@pytest.fixture
def umask():
    previous = os.umask(0o022)
    yield 0o022
    os.umask(previous)
