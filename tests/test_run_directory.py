"""A run directory belongs to one run, and a finished result is never lost or overwritten."""

from __future__ import annotations

import copy
import errno
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from amp_exp.config.values import validate
from amp_exp.errors import NumericalFault, RunRefused, RuntimeFault
from amp_exp.results.ownership import RunDirectoryBusy, RunDirectoryLock, holder_of
from amp_exp.results.resume import config_changes
from amp_exp.results.summary import record_failure
from amp_exp.run import train
from helpers.runs import FAST, TINY, composed, read_jsonl, signal_self_at_call
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


def amp_exp_in(amp_exp_here, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``amp_exp_cli`` through the command's entry point in this process: for the exit statuses
    and lines of commands the pre-flight answers, which no process of their own changes."""
    return amp_exp_here(*FAST, *overrides, f"hydra.run.dir={run_dir}")


def test_a_second_process_is_refused_while_the_first_holds_the_directory(
    tmp_path, lock_elsewhere
) -> None:
    holder = f"pid {os.getpid()} on {socket.gethostname()}"
    with RunDirectoryLock(tmp_path):
        # The pre-flight takes the lock, then the run takes it again, in one process.
        with RunDirectoryLock(tmp_path):
            pass
        assert holder in lock_elsewhere.take(tmp_path)
        assert holder_of(tmp_path) is None  # this process holds it: not in its own way
    assert lock_elsewhere.take(tmp_path).strip() == "taken"  # released with the last


def test_the_lock_dies_with_its_process(tmp_path, lock_elsewhere) -> None:
    holder = lock_elsewhere.hold(tmp_path)
    with pytest.raises(RunDirectoryBusy, match=f"pid {holder.pid}"):
        RunDirectoryLock(tmp_path).__enter__()
    holder.send_signal(signal.SIGKILL)  # no handler runs, the OS drops the lock
    holder.wait()
    with RunDirectoryLock(tmp_path):
        pass


def assert_refused_in_one_line(result: subprocess.CompletedProcess, status: int, says: str) -> None:
    assert result.returncode == status, result.stderr[-2000:]
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("amp_exp: error: ") and says in line, line


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A run directory as a completed CLI run leaves it: Hydra's files, train.log, results."""
    run_dir = tmp_path_factory.mktemp("finished")
    result = amp_exp_cli(run_dir, *SHORT, "checkpoint.every_steps=2")
    assert result.returncode == 0, result.stderr[-2000:]
    return run_dir


@pytest.fixture
def finished_copy(finished_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


@pytest.fixture(scope="module")
def trained_once(tmp_path_factory) -> Callable[..., tuple[Path, dict]]:
    """``trained_once(*overrides)``: the directory and summary of ``train(run_cfg(*SHORT,
    *overrides), ...)``, trained once for this module's tests of what may happen next."""
    runs: dict[tuple[str, ...], tuple[Path, dict]] = {}

    def trained(*overrides: str) -> tuple[Path, dict]:
        if overrides not in runs:
            out = tmp_path_factory.mktemp("trained")
            cfg = validate(copy.deepcopy(composed((*FAST, *SHORT, *overrides))))
            runs[overrides] = out, train(cfg, out)
        return runs[overrides]

    return trained


@pytest.fixture
def train_here(trained_once, tmp_path) -> Callable[..., dict]:
    """``train_here(*overrides)``: what ``train(run_cfg(*SHORT, *overrides), tmp_path)``
    leaves in tmp_path and returns, copied from the module's one run of that config."""

    def here(*overrides: str) -> dict:
        source, summary = trained_once(*overrides)
        shutil.copytree(source, tmp_path, dirs_exist_ok=True)
        return copy.deepcopy(summary)

    return here


@pytest.mark.slow
def test_a_run_in_a_busy_directory_exits_2_in_one_line_and_touches_nothing(finished_copy) -> None:
    (finished_copy / "summary.json").unlink()  # a run that is still going
    with RunDirectoryLock(finished_copy):
        before = snapshot(finished_copy)
        result = amp_exp_cli(finished_copy, *SHORT, "precision=bf16", "resume=auto")
    assert_refused_in_one_line(result, 2, f"is in use by pid {os.getpid()}")
    # Not even Hydra's .hydra/*.yaml and train.log: a report would list the job as it ran.
    assert snapshot(finished_copy) == before


@pytest.mark.slow
@pytest.mark.parametrize(
    ("overrides", "status", "says"),
    [
        # A fresh run of another seed, precision or length over the completed one.
        (["seed=1"], 2, "holds a completed run (4 steps); a new run there would overwrite it"),
        (["precision=bf16"], 2, "continue it with resume=auto"),
        (["trainer.max_steps=3"], 2, "or give this run its own directory"),
        (["resume=auto", "seed=1"], 2, "belongs to another experiment (seed: 0 -> 1)"),
    ],
)
def test_a_refused_command_writes_nothing(
    finished_copy, overrides, status, says, amp_exp_here
) -> None:
    before = snapshot(finished_copy)
    result = amp_exp_in(amp_exp_here, finished_copy, *SHORT, "checkpoint.every_steps=2", *overrides)
    assert_refused_in_one_line(result, status, says)
    assert snapshot(finished_copy) == before


@pytest.mark.slow
def test_a_resume_where_no_checkpoint_loads_exits_4_and_writes_nothing(
    finished_copy, amp_exp_here
) -> None:
    (finished_copy / "summary.json").unlink()  # killed after its last checkpoint
    for checkpoint in (finished_copy / "checkpoints").iterdir():
        checkpoint.write_bytes(b"not a checkpoint")
    before = snapshot(finished_copy)
    result = amp_exp_in(amp_exp_here, finished_copy, *SHORT, "resume=auto", "trainer.max_steps=6")
    assert_refused_in_one_line(result, 4, "no checkpoint in")
    assert snapshot(finished_copy) == before  # no failed summary.json either


@pytest.mark.slow
def test_a_refused_resume_into_a_new_directory_leaves_no_directory(
    finished_run, tmp_path, amp_exp_here
) -> None:
    new_dir = tmp_path / "new" / "run"
    result = amp_exp_in(amp_exp_here, new_dir, *SHORT, f"resume={finished_run}", "seed=1")
    assert_refused_in_one_line(result, 2, "belongs to another experiment")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_resuming_a_completed_cli_run_does_nothing_and_writes_nothing(
    finished_copy, amp_exp_here
) -> None:
    before = snapshot(finished_copy)
    result = amp_exp_in(
        amp_exp_here, finished_copy, *SHORT, "checkpoint.every_steps=2", "resume=auto"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == (
        "amp_exp: resume=auto: this run completed at step 4; nothing to do, its results stay "
        "as they are"
    )
    assert snapshot(finished_copy) == before


@pytest.mark.slow
@pytest.mark.usefixtures("pngs_not_rasterized")  # read for its words (conftest)
def test_a_second_sweep_into_a_sweep_directory_is_refused_unless_it_resumes(
    tmp_path, amp_exp_here
) -> None:
    sweep = [*FAST, *SHORT, "seed=0,1", f"hydra.sweep.dir={tmp_path}"]
    # Through the entry point in this process: the refusal and the resume are the pre-flight's
    # and the sweeper's, the same in a process of their own.
    first = amp_exp_here("-m", *sweep)
    assert first.returncode == 0, first.stderr[-2000:]
    before = snapshot(tmp_path)
    again = amp_exp_here("-m", *sweep)  # refused by the pre-flight
    assert_refused_in_one_line(again, 2, "holds the results of an earlier sweep (jobs 0, 1)")
    assert snapshot(tmp_path) == before
    resumed = amp_exp_here("-m", *sweep, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert resumed.stdout.count("this run completed at step 4; nothing to do") == 2
    for job in ("0", "1"):
        assert (tmp_path / job / "summary.json").read_bytes() == before[f"{job}/summary.json"]


def test_resume_skips_a_torn_last_line_and_says_so(run_cfg, train_here, tmp_path, caplog) -> None:
    train_here("checkpoint.every_steps=2")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + "5}")  # a writer killed mid-line
    (tmp_path / "summary.json").unlink()  # as if killed before the end
    with caplog.at_level(logging.WARNING):
        summary = train(run_cfg(*SHORT, "resume=auto", "trainer.max_steps=6"), tmp_path)
    assert summary["status"] == "completed" and "unreadable line" in caplog.text
    assert [r["step"] for r in read_jsonl(metrics) if r["kind"] == "train"] == [2, 4, 6]


def test_resuming_a_completed_run_does_nothing_and_says_so(
    run_cfg, train_here, tmp_path, caplog
) -> None:
    train_here()
    before = snapshot(tmp_path)
    with caplog.at_level(logging.INFO):
        summary = train(run_cfg(*SHORT, "resume=auto"), tmp_path)
    assert "completed at step 4; nothing to do" in caplog.text
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert snapshot(tmp_path) == {**before, ".amp_exp.lock": before[".amp_exp.lock"]}


@pytest.mark.parametrize(
    "override", ["seed=1", "precision=bf16", "trainer.max_steps=3", "checkpoint.every_steps=null"]
)
def test_a_new_run_never_replaces_a_completed_one(run_cfg, train_here, tmp_path, override) -> None:
    train_here()
    before = snapshot(tmp_path)
    with pytest.raises(RunRefused, match="holds a completed run") as refused:
        train(run_cfg(*SHORT, override), tmp_path)
    assert "\n" not in str(refused.value)
    assert snapshot(tmp_path) == before


def test_a_fresh_start_never_replaces_the_checkpoints_of_a_run_that_can_go_on(
    run_cfg, train_here, tmp_path
) -> None:
    train_here("checkpoint.every_steps=2")
    (tmp_path / "summary.json").unlink()  # killed after a checkpoint
    before = snapshot(tmp_path)
    with pytest.raises(RunRefused, match=r"holds the checkpoints of a run that can go on"):
        train(run_cfg(*SHORT), tmp_path)
    assert snapshot(tmp_path) == before


def test_a_completed_run_without_checkpoints_is_never_started_over(run_cfg, tmp_path) -> None:
    no_checkpoints = [*SHORT, "checkpoint.every_steps=null"]
    completed = train(run_cfg(*no_checkpoints), tmp_path)
    before = snapshot(tmp_path)
    # Asked for the same training: nothing to do.
    assert train(run_cfg(*no_checkpoints, "resume=auto"), tmp_path) == completed
    with pytest.raises(RunRefused, match="completed at step 4 and saved no checkpoint"):
        train(run_cfg(*no_checkpoints, "resume=auto", "trainer.max_steps=6"), tmp_path)
    with pytest.raises(RunRefused, match=r"belongs to another experiment \(seed: 0 -> 1\)"):
        train(run_cfg(*no_checkpoints, "resume=auto", "seed=1"), tmp_path)
    assert snapshot(tmp_path) == before


def test_a_failed_attempt_without_checkpoints_may_be_run_again(run_cfg, tmp_path) -> None:
    record_failure(tmp_path, {}, NumericalFault("scale collapsed"))
    assert train(run_cfg(*SHORT), tmp_path)["status"] == "completed"


def test_resume_takes_the_newest_checkpoint_even_when_last_pt_is_older(
    run_cfg, tmp_path, monkeypatch
) -> None:
    """A full disk at step 4 let step_00000004.pt through and stopped last.pt (still step 2)."""
    real_save, steps_saved = torch.save, []

    def disk_full_on_the_second_last_pt(payload, file) -> None:
        # Each step saves step_<N>.pt, then last.pt.
        steps_saved.append(payload["step"])
        if steps_saved == [2, 2, 4, 4]:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(payload, file)

    monkeypatch.setattr(torch, "save", disk_full_on_the_second_last_pt)
    run = [*SHORT, "checkpoint.every_steps=2", "checkpoint.keep=2"]
    with pytest.raises(RuntimeFault, match=r"last\.pt"):
        train(run_cfg(*run), tmp_path)
    monkeypatch.setattr(torch, "save", real_save)
    checkpoints = tmp_path / "checkpoints"
    assert torch.load(checkpoints / "last.pt", weights_only=True)["step"] == 2
    summary = train(run_cfg(*run, "resume=auto", "trainer.max_steps=6"), tmp_path)
    assert summary["resumed_from"] == str(checkpoints / "step_00000004.pt")
    assert summary["steps"] == 6
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"] == [
        2,
        4,
        6,
    ]


def test_metrics_lines_that_are_no_rows_are_skipped_on_resume(
    run_cfg, train_here, tmp_path, caplog
) -> None:
    train_here("checkpoint.every_steps=2")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_bytes(b"{}\n[1]\n\xff\xfe\n" + metrics.read_bytes())
    (tmp_path / "summary.json").unlink()
    with caplog.at_level(logging.WARNING):
        summary = train(run_cfg(*SHORT, "resume=auto", "trainer.max_steps=6"), tmp_path)
    assert summary["status"] == "completed" and "skipped 3 unreadable line(s)" in caplog.text
    assert [r["step"] for r in read_jsonl(metrics) if r["kind"] == "train"] == [2, 4, 6]


def test_a_completed_run_can_be_extended(run_cfg, train_here, tmp_path) -> None:
    train_here()
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
    run_cfg, train_here, tmp_path, override, named
) -> None:
    train_here("checkpoint.every_steps=2", "trainer.max_steps=6")
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


def test_a_failure_never_replaces_a_completed_summary(run_cfg, train_here, tmp_path) -> None:
    completed = train_here()
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


def test_temporaries_of_a_killed_save_are_swept_on_the_next_start(
    run_cfg, train_here, tmp_path
) -> None:
    train_here("checkpoint.every_steps=2")
    stale = tmp_path / "checkpoints" / ".last.pt.k3j2.tmp"
    stale.write_bytes(b"half a checkpoint")
    train(run_cfg(*SHORT, "resume=auto", "trainer.max_steps=6"), tmp_path)
    assert not stale.exists()


def test_a_run_resumed_at_its_final_step_keeps_its_speed(run_cfg, train_here, tmp_path) -> None:
    first = train_here()
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


@pytest.mark.slow
def test_the_directory_claim_does_not_import_the_engine_or_fsdp() -> None:
    """Every command's pre-flight claims its directory by results/ownership.py's rules, which
    read resume.py's; the engine and torch.distributed.fsdp (a second or more of start-up) come
    in only to restore a run, so an import of either at module level fails here."""
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, amp_exp.results.ownership; "
            "print(sorted(m for m in sys.modules if m == 'amp_exp.training.engine' "
            "or m.startswith('torch.distributed.fsdp')))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert loaded.stdout.strip() == "[]"
