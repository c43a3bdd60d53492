"""Checkpoints: exact resume, atomic saves, safe loads, preemption and numerical faults."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import pickle
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from amp_exp.errors import NoCheckpointLoads, NumericalFault, RuntimeFault
from amp_exp.results.checkpoint import (
    Checkpointer,
    UnusableCheckpoints,
    load_newest_valid,
    load_shards,
)
from amp_exp.results.dcp_reader import read_metadata
from amp_exp.run import build, train
from amp_exp.runtime.distributed import process_group
from amp_exp.runtime.fsdp import state_template
from helpers.runs import FAST, TINY, read_jsonl, signal_self_at_call
from helpers.warm_python import start_python_m

# The shared tiny run at batch 32: 256 samples make 8 batches an epoch.
TINY32 = [*TINY, "dataset.batch_size=32"]
# 256 samples / batch 32 = 8 batches an epoch; 12 steps cross one epoch boundary.
EXACT = [*TINY32, "trainer.max_steps=12", "trainer.log_every=2", "trainer.eval_every=null"]
TIMING_KEYS = {"samples_per_s", "step_time_ms", "peak_mem_bytes"}


def assert_same_state(a, b, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_same_state(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING_KEYS} for row in rows]


@pytest.mark.parametrize(
    "precision",
    [
        "precision=fp32",
        "precision=bf16",
        # A huge initial scale makes the first steps skip, so the scaler state really evolves.
        "precision=fp16 precision.init_scale=16777216 precision.growth_interval=3",
    ],
)
def test_stopped_and_resumed_run_matches_uninterrupted_run(
    run_cfg, override_loss, tmp_path, precision
) -> None:
    whole = assert_resume_is_exact(run_cfg, override_loss, tmp_path, [*EXACT, *precision.split()])
    if "fp16" in precision:
        assert whole["skipped_steps"] > 0


# An MLP whose hidden linears take fp8 (dimensions multiples of 16; 3x8x8 inputs). Diagnostics
# are off: their stale-weight window restarts at a resume (training/diagnostics.py).
MODES = [
    "model=mlp",
    "model.hidden_dim=16",
    "model.depth=3",
    "dataset.image_size=8",
    "dataset.batch_size=32",
    "trainer.max_steps=12",
    "trainer.log_every=2",
    "trainer.eval_every=null",
    "diagnostics.underflow_every=0",
]


@pytest.mark.parametrize(
    "precision",
    [
        "precision=bf16_true",
        "precision=bf16_true optimizer=adamw",
        "precision=bf16_true_nearest",
        "precision=fp8 precision.emulate=true optimizer=adamw",
    ],
)
def test_bf16_true_and_emulated_fp8_resume_exactly(
    run_cfg, override_loss, tmp_path, precision
) -> None:
    assert_resume_is_exact(run_cfg, override_loss, tmp_path, [*MODES, *precision.split()])
    payload = torch.load(tmp_path / "whole" / "checkpoints" / "last.pt", weights_only=True)
    dtypes = {t.dtype for t in payload["model"].values() if t.is_floating_point()}
    assert dtypes == ({torch.bfloat16} if "bf16_true" in precision else {torch.float32})


def assert_resume_is_exact(run_cfg, override_loss, tmp_path, overrides: list[str]) -> dict:
    """Train 12 steps whole, and stopped after step 5 then resumed: the end states, and the
    rows, must be identical. Returns the uninterrupted run's summary."""
    whole = train(run_cfg(*overrides), tmp_path / "whole")
    # The signal arrives during step 5 (mid-epoch, mid-log-interval); the run stops after it.
    override_loss(signal_self_at_call(5))
    first = train(run_cfg(*overrides), tmp_path / "split")
    assert (first["status"], first["steps"], first["stop_signal"]) == ("stopped", 5, "SIGUSR1")
    second = train(run_cfg(*overrides, "resume=auto"), tmp_path / "split")
    assert second["status"] == "completed" and second["steps"] == 12
    assert second["resumed_from"].endswith("last.pt")
    assert second["skipped_steps"] == whole["skipped_steps"]

    ends = [
        torch.load(tmp_path / run / "checkpoints" / "last.pt", weights_only=True)
        for run in ("whole", "split")
    ]
    for part in ("model", "optimizer", "scaler", "scheduler", "progress"):
        assert_same_state(ends[0][part], ends[1][part], part)
    whole_rows = read_jsonl(tmp_path / "whole" / "metrics.jsonl")
    split_rows = read_jsonl(tmp_path / "split" / "metrics.jsonl")
    assert without_timing(split_rows) == without_timing(whole_rows)
    return whole


def test_checkpoint_holds_the_documented_fields(run_cfg, tmp_path) -> None:
    train(run_cfg(*TINY32, "precision=bf16"), tmp_path)
    payload = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert {"model", "optimizer", "scaler", "scheduler", "step", "epoch", "batch_in_epoch"} <= set(
        payload
    )
    assert payload["scaler"] is None and payload["precision"] == "bf16"
    # Every rank's generators, by rank: this process's CPU, device (none on the CPU), Python's
    # and NumPy's.
    (rng,) = payload["rng"]
    assert set(rng) == {"torch", "device", "python", "numpy"} and rng["device"] is None
    assert set(payload["skip_record"]) == {"record"}
    assert payload["config"]["precision"]["name"] == "bf16"
    assert (payload["step"], payload["epoch"], payload["batch_in_epoch"]) == (4, 0, 4)


def test_keep_prunes_numbered_checkpoints(run_cfg, tmp_path) -> None:
    train(run_cfg(*TINY32, "checkpoint.every_steps=1", "checkpoint.keep=2"), tmp_path)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["last.pt", "step_00000003.pt", "step_00000004.pt"]


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch) -> None:
    def state(step: int, weight: torch.Tensor) -> dict:
        return {"progress": {"step": step, "epoch": 0, "batch_in_epoch": step}, "model": weight}

    writer = Checkpointer(tmp_path, every_steps=0, keep=0, metadata={})
    writer.save(state(1, torch.ones(3)))
    real_save = torch.save

    def crash_midway(obj, f, *args, **kwargs):
        f.write(b"partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash_midway)
    with pytest.raises(RuntimeFault, match=r"\(disk full\); the previous last.pt is intact"):
        writer.save(state(2, torch.zeros(3)))
    monkeypatch.setattr(torch, "save", real_save)
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]
    _, payload = load_newest_valid(tmp_path / "last.pt")
    assert payload["step"] == 1


def test_truncated_newest_checkpoint_falls_back_with_a_warning(
    override_loss, run_cfg, tmp_path, caplog
) -> None:
    cfg = [*TINY32, "checkpoint.every_steps=2", "checkpoint.keep=1", "trainer.max_steps=6"]
    override_loss(signal_self_at_call(4))
    train(run_cfg(*cfg), tmp_path)
    last = tmp_path / "checkpoints" / "last.pt"
    last.write_bytes(last.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        summary = train(run_cfg(*cfg, "resume=auto"), tmp_path)
    assert "last.pt is unusable" in caplog.text
    assert summary["resumed_from"].endswith("step_00000004.pt")
    assert summary["steps"] == 6


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickled_code_payload_is_refused_and_never_runs(tmp_path, caplog) -> None:
    marker = tmp_path / "payload-ran"
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "last.pt").write_bytes(pickle.dumps({"progress": Payload(marker)}, protocol=2))
    with caplog.at_level(logging.WARNING), pytest.raises(UnusableCheckpoints):
        load_newest_valid(tmp_path)
    assert not marker.exists()
    assert "unusable" in caplog.text
    # Without weights_only the same file would have run its payload.
    pickle.loads((checkpoints / "last.pt").read_bytes())
    assert marker.exists()


class ShellPayload:
    """What an attacker puts in a pickle: a shell command run as the pickle is read."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


# FSDP2 in a group of one process: a DCP checkpoint, step_00000004/, as under torchrun.
SHARDED = [*TINY32, "trainer.strategy=fsdp2", "checkpoint.every_steps=2"]


@pytest.fixture
def sharded_run(run_cfg, tmp_path) -> Path:
    train(run_cfg(*SHARDED), tmp_path)
    return tmp_path / "checkpoints" / "step_00000004"


def assert_resume_refused_unrun(run_cfg, run_dir: Path, marker: Path, says: str) -> None:
    with pytest.raises(NoCheckpointLoads) as refused:
        train(run_cfg(*SHARDED, "resume=auto", "trainer.max_steps=6"), run_dir)
    message = str(refused.value)
    assert "\n" not in message and "step_00000004: " in message and says in message, message
    assert not marker.exists()


def test_a_dcp_metadata_file_that_smuggles_code_is_refused_and_never_runs(
    run_cfg, tmp_path, sharded_run
) -> None:
    marker = tmp_path / "payload-ran"
    (sharded_run / ".metadata").write_bytes(pickle.dumps(ShellPayload(marker)))
    assert_resume_refused_unrun(run_cfg, tmp_path, marker, ".metadata refers to posix.system")
    # torch's own reader would have run it.
    with pytest.raises(CheckpointException):
        dcp.load({}, checkpoint_id=sharded_run)
    assert marker.exists()


def smuggle_into_a_value(step_dir: Path, payload: object) -> str:
    """Point one non-tensor value of a DCP checkpoint (an optimizer hyperparameter) at a pickle
    of ``payload`` appended to its shard file, in a metadata file that is itself clean."""
    metadata = read_metadata(step_dir / ".metadata")
    index, where = next(
        (index, where)
        for index, where in metadata.storage_data.items()
        if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata)
    )
    shard = step_dir / where.relative_path
    smuggled = io.BytesIO()
    torch.save(payload, smuggled)
    offset = shard.stat().st_size
    with shard.open("ab") as file:
        file.write(smuggled.getvalue())
    metadata.storage_data[index] = dataclasses.replace(
        where, offset=offset, length=len(smuggled.getvalue())
    )
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    return index.fqn


def test_a_dcp_value_that_smuggles_code_is_refused_and_never_runs(
    run_cfg, tmp_path, sharded_run
) -> None:
    marker = tmp_path / "payload-ran"
    fqn = smuggle_into_a_value(sharded_run, ShellPayload(marker))
    assert_resume_refused_unrun(run_cfg, tmp_path, marker, f"the value of {fqn} is not plain data")
    # Loading the shards refuses it too, should a checkpoint reach them unchecked.
    cfg = run_cfg(*SHARDED)
    with process_group(cfg.trainer.device, cfg.trainer.strategy) as alone:
        engine = build(cfg, distributed=alone).engine
        template = state_template(engine.model, engine.optimizer, with_optimizer=True)
        with pytest.raises(RuntimeFault, match=f"do not load: .*the value of {fqn} is not plain"):
            load_shards(sharded_run, template)
    assert not marker.exists()


@pytest.mark.slow
def test_cli_resume_from_a_smuggling_dcp_checkpoint_exits_4_in_one_line(
    tmp_path, sharded_run, amp_exp_here
) -> None:
    """The run trained in this process (sharded_run); its resume from the command line,
    through the entry point, in this process."""
    run = [*FAST, *SHARDED, f"hydra.run.dir={tmp_path}"]
    marker = tmp_path / "payload-ran"
    (sharded_run / ".metadata").write_bytes(pickle.dumps(ShellPayload(marker)))
    result = amp_exp_here(*run, "resume=auto", "trainer.max_steps=6")
    assert result.returncode == 4, result.stderr[-3000:]
    [line] = result.stderr.splitlines()
    assert (
        line.startswith("amp_exp: error: resume=auto: no checkpoint in") and "posix.system" in line
    )
    assert not marker.exists()


def test_resume_in_another_precision_warns_what_is_reset(run_cfg, tmp_path, caplog) -> None:
    train(run_cfg(*TINY32, "precision=fp16", "trainer.max_steps=2"), tmp_path / "a")
    with caplog.at_level(logging.WARNING):
        summary = train(
            run_cfg(*TINY32, "precision=bf16", f"resume={tmp_path / 'a'}"), tmp_path / "b"
        )
    assert "resuming a fp16 checkpoint in bf16: its GradScaler state is dropped" in caplog.text
    assert summary["steps"] == 4
    assert [r["step"] for r in read_jsonl(tmp_path / "b" / "metrics.jsonl") if "loss" in r] == [
        2,
        4,
    ]


def inf_after(calls_ok: int):
    calls = 0

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        loss = F.cross_entropy(logits, labels)
        return loss if calls <= calls_ok else loss * float("inf")

    return loss_fn


def test_stuck_fp16_run_stops_with_a_diagnosis_and_keeps_the_last_good_checkpoint(
    override_loss, run_cfg, tmp_path
) -> None:
    cfg = run_cfg(
        *TINY32,
        "precision=fp16",
        "precision.max_consecutive_skips=5",
        "precision.min_scale=1e-30",
        "checkpoint.every_steps=2",
        "trainer.max_steps=20",
    )
    with pytest.raises(NumericalFault) as fault:
        override_loss(inf_after(4))
        train(cfg, tmp_path)
    # Skipped from step 5 on, read at each log step (every 2): the run reached 5 by step 10.
    message = str(fault.value)
    assert "collapsed by step 10: 6 consecutive skipped steps" in message
    assert "Scale history (step:scale): 6:16384, 8:4096, 10:1024" in message
    assert "the forward pass (or the loss) overflowed" in message
    assert "first features.0.weight" in message
    assert "lower precision.init_scale, precision=bf16, precision.clip_grad_norm=1.0, or" in message
    last = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert last["step"] == 4


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_run_without_a_scaler_that_skips_step_after_step_stops_as_fp16_does(
    run_cfg, override_loss, precision
) -> None:
    """One rule for every precision: precision.max_consecutive_skips skipped steps in a row stop
    the run (exit status 3); it never completes having trained nothing."""
    cfg = run_cfg(
        *TINY32,
        f"precision={precision}",
        "precision.max_consecutive_skips=3",
        "trainer.max_steps=8",
    )
    override_loss(inf_after(1))
    with pytest.raises(NumericalFault) as fault:
        build(cfg).engine.fit(lambda row: None)
    assert str(fault.value) == (
        f"training stalled by step 4 in {precision}: 3 consecutive skipped steps "
        "(precision.max_consecutive_skips), the gradients non-finite every time, first in "
        "features.0.weight. Try a lower optimizer.lr or precision.clip_grad_norm=1.0; the last "
        "good checkpoint is kept"
    )
    assert fault.value.exit_status == 3


def test_a_resume_in_another_precision_keeps_each_attempts_precision_and_speed_apart(
    run_cfg, override_loss, tmp_path
) -> None:
    """fp16 stopped at step 3, resumed as fp32: the run's speed is fp32's alone, and the
    summary lists both attempts with their own."""
    # Without the audit, whose step each attempt leaves off its clock.
    overrides = [
        *TINY32,
        "trainer.max_steps=6",
        "trainer.eval_every=null",
        "diagnostics.audit=false",
    ]
    override_loss(signal_self_at_call(3))
    first = train(run_cfg(*overrides, "precision=fp16"), tmp_path)
    assert (first["status"], first["steps"]) == ("stopped", 3)
    second = train(run_cfg(*overrides, "precision=fp32", "resume=auto"), tmp_path)
    assert (second["status"], second["precision"]) == ("completed", "fp32")
    fp16, fp32 = second["attempts"]
    assert (fp16["precision"], fp16["first_step"], fp16["last_step"]) == ("fp16", 1, 3)
    assert (fp32["precision"], fp32["first_step"], fp32["last_step"]) == ("fp32", 4, 6)
    assert fp16["samples_per_s"] == first["samples_per_s"]
    assert first["attempts"] == [fp16]
    # One warm-up step, then steps 5 and 6 timed: nothing of fp16's in the run's figures.
    assert (second["samples_per_s"], second["step_time_ms"]) == (
        fp32["samples_per_s"],
        fp32["step_time_ms"],
    )
    assert second["timed_steps"] == fp32["timed_steps"] == 2


def test_fp16_scale_below_min_scale_stops_the_run(override_loss, run_cfg) -> None:
    cfg = run_cfg(*TINY32, "precision=fp16", "precision.init_scale=4", "precision.min_scale=1")
    with pytest.raises(NumericalFault, match=r"by step 4: loss scale 0\.25 fell below"):
        override_loss(inf_after(0))
        build(cfg).engine.fit(lambda row: None)


def test_nan_loss_in_bf16_is_skipped_and_leaves_the_weights(run_cfg, override_loss) -> None:
    override_loss(inf_after(0))
    built = build(run_cfg(*TINY32, "precision=bf16", "trainer.max_steps=2"))
    before = [p.detach().clone() for p in built.model.parameters()]
    result = built.engine.fit(lambda row: None)
    assert result.progress.skipped_steps == 2
    assert all(torch.equal(a, b) for a, b in zip(before, built.model.parameters(), strict=True))


def test_nan_loss_in_fp32_with_stop_stops(run_cfg, override_loss) -> None:
    override_loss(inf_after(1))
    built = build(run_cfg(*TINY32, "trainer.on_nonfinite=stop"))
    with pytest.raises(NumericalFault, match="non-finite gradients at step 2 in fp32"):
        built.engine.fit(lambda row: None)


@pytest.mark.slow
def test_sigterm_checkpoints_exits_cleanly_and_resumes(tmp_path, amp_exp_here) -> None:
    """The run that is signalled has a process of its own (its exit status is the process's);
    the resume runs through the entry point, in this process."""

    def overrides(max_steps: int, *extra: str) -> list[str]:
        return [
            *FAST,
            *TINY32,
            f"trainer.max_steps={max_steps}",
            "trainer.log_every=10",
            f"hydra.run.dir={tmp_path}",
            *extra,
        ]

    # Far more steps than it can run before the signal arrives.
    process = start_python_m("amp_exp", *overrides(1_000_000), timeout=240)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().strip()):
        assert process.poll() is None and time.monotonic() < deadline, process.read_stdout()
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    output = "".join(process.communicate())
    assert process.returncode == 128 + signal.SIGTERM, output
    assert "SIGTERM received" in output
    stopped_at = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["step"]
    assert stopped_at >= 10

    finish = (stopped_at // 10 + 3) * 10
    resumed = amp_exp_here(*overrides(finish, "resume=auto"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [r["step"] for r in read_jsonl(metrics) if "loss" in r]
    assert steps == list(range(10, finish + 1, 10))


@pytest.fixture
def ctrl_c_handled():
    """SIGINT raising KeyboardInterrupt, as in an interactive shell, whatever the test runner
    inherited (nohup and background jobs start with SIGINT ignored); restored afterwards."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_second_sigint_exits_at_once(ctrl_c_handled) -> None:
    from amp_exp.runtime.signals import StopRequest

    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop() and stop.requested is signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_sigint_stays_ignored() -> None:
    from amp_exp.runtime.signals import StopRequest

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopRequest() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert not stop()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
