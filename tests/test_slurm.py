"""Sweeps through Hydra's submitit launchers: reports, and requeued jobs that resume.

No SLURM here: submitit's local executor runs the same launcher code, and its controller sends
SIGUSR2 ``signal_delay_s`` before ``timeout_min`` and restarts a job that asks to be requeued, as
SLURM does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.plugins import Plugins
from omegaconf import DictConfig

from amp_exp.config.preflight import CONF_DIR, CONFIG_NAME
from helpers.runs import FAST, TINY, TINY_MLP, read_jsonl, run_cli
from helpers.torchrun import DDP_RUN
from helpers.warm_python import start_python_m

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

from amp_exp.runtime.signals import StopRequest
from hydra_plugins._amp_exp_submitit import LocalConf, with_resume

slow = pytest.mark.slow
TESTS_DIR = Path(__file__).resolve().parent
LAUNCHERS = "hydra_plugins._amp_exp_submitit"


def job_env() -> dict[str, str]:
    # The jobs import tests/requeue_pace.py, which the requeue test names as a Hydra callback.
    path = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH")]))
    # One torch thread per job: on a busy 2-core machine, two threads per tiny job ran up to 20x
    # slower (each step waits for whichever thread was descheduled), and timings here matter.
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def amp_exp(
    *args: str, expect_rc: int = 0, timeout: int = 300, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return run_cli(*args, expect_rc=expect_rc, timeout=timeout, env=job_env(), cwd=cwd)


# --- the pieces ----------------------------------------------------------------------------------


def launcher_cfg(name: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(CONFIG_NAME, [f"hydra/launcher={name}"], return_hydra_config=True)
    return cfg.hydra.launcher


def test_requeued_overrides_resume_unless_they_set_resume() -> None:
    assert with_resume(["precision=bf16"]) == ["precision=bf16", "resume=auto"]
    for explicit in ("resume=null", "resume=/runs/a", "+resume=auto", "++resume=/runs/b"):
        assert with_resume(["precision=bf16", explicit]) == ["precision=bf16", explicit]


def test_checkpoint_hook_resubmits_the_same_job_with_resume() -> None:
    from hydra_plugins._amp_exp_submitit import LocalLauncher, SlurmLauncher

    for launcher in (LocalLauncher(), SlurmLauncher()):
        args = (["precision=fp16"], "hydra.sweep.dir", 3, "job_id_for_3", {})
        delayed = launcher.checkpoint(*args)
        assert delayed.function is launcher
        assert delayed.args == (["precision=fp16", "resume=auto"], *args[1:])


def test_a_job_slurm_requeued_by_itself_resumes_too(monkeypatch) -> None:
    from hydra_plugins._amp_exp_submitit import SlurmLauncher

    ran_with = []
    plugin_launcher = SlurmLauncher.__bases__[-1]
    monkeypatch.setattr(plugin_launcher, "__call__", lambda self, o, *a: ran_with.append(o))
    launcher = SlurmLauncher()
    launcher(["precision=fp16"], "hydra.sweep.dir", 0, "job_id_for_0", {})
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    launcher(["precision=fp16"], "hydra.sweep.dir", 0, "job_id_for_0", {})
    assert ran_with == [["precision=fp16"], ["precision=fp16", "resume=auto"]]


def test_our_launchers_replace_the_plugins_entries() -> None:
    # Plugin discovery has run (register_plugins runs it first); it must not have the last word.
    Plugins.instance()
    for name, target in (
        ("submitit_local", f"{LAUNCHERS}.LocalLauncher"),
        ("submitit_slurm", f"{LAUNCHERS}.SlurmLauncher"),
        ("slurm", f"{LAUNCHERS}.SlurmLauncher"),
    ):
        assert launcher_cfg(name)._target_ == target, name
        assert Plugins.instance().class_name_to_class[target].__module__ == LAUNCHERS
    local = launcher_cfg("submitit_local")
    assert (local.signal_delay_s, local.max_num_timeout) == (
        LocalConf.signal_delay_s,
        LocalConf.max_num_timeout,
    )
    preset = launcher_cfg("slurm")
    assert preset.max_num_timeout > 0 and preset.gpus_per_node == 1


def test_local_signal_delay_reaches_submitits_executor(tmp_path: Path) -> None:
    import submitit
    from submitit.local.local import LocalExecutor

    from hydra_plugins._amp_exp_submitit import _local_parameter_accepted

    executor = submitit.AutoExecutor(folder=tmp_path, cluster="local")
    with _local_parameter_accepted("signal_delay_s"):
        executor.update_parameters(timeout_min=1, local_signal_delay_s=45)
    assert executor._executor.parameters["signal_delay_s"] == 45
    assert LocalExecutor._valid_parameters() == {"setup"}  # restored


def test_hand_over_passes_each_signal_to_the_python_handler_it_displaced() -> None:
    # submitit's own handlers: SIGTERM is only logged, SIGUSR2 checkpoints and requeues. SLURM's
    # preemption sends SIGTERM, then SIGUSR2; SIGUSR1 had no Python handler (SIG_DFL).
    received: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, frame: received.append(signum))
        for sig in (signal.SIGTERM, signal.SIGUSR2)
    }
    try:
        with StopRequest() as stop:
            for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGUSR1):
                os.kill(os.getpid(), sig)
        assert received == []  # not before the run is over
        assert stop.requested is signal.SIGTERM
        stop.hand_over()
        assert received == [signal.SIGTERM, signal.SIGUSR2]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_hand_over_leaves_ctrl_c_and_default_handlers_alone() -> None:
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGUSR1)
    stop.hand_over()  # default_int_handler would raise KeyboardInterrupt, SIG_DFL would kill us
    signal.signal(signal.SIGINT, previous)
    assert stop.requested is signal.SIGINT


def test_without_the_plugin_the_error_says_what_to_install(monkeypatch) -> None:
    from hydra.errors import MissingConfigException

    from amp_exp.config import preflight as cli

    monkeypatch.setattr(cli, "find_spec", lambda name: None)
    error = MissingConfigException("Could not load", "hydra/launcher/submitit_slurm")
    assert cli.describe_error(error) == (
        "hydra/launcher/submitit_slurm needs hydra-submitit-launcher: pip install 'amp_exp[slurm]'"
    )


# --- end to end ----------------------------------------------------------------------------------


@slow
def test_submitit_local_sweep_reports_every_job_whose_two_tasks_are_its_ranks(
    tmp_path: Path,
) -> None:
    """tasks_per_node=2 through submitit's local executor: the two tasks of a job are its ranks,
    every job writes into the sweep directory the launcher made (the default one), and the report
    counts each job once."""
    amp_exp(
        "-m",
        "hydra/launcher=submitit_local",
        "hydra.launcher.tasks_per_node=2",
        *DDP_RUN,
        # An MLP: what is checked is who trains and who reports, not a model (bf16 convolutions
        # cost this CPU far more a step than the MLP's matmuls).
        *TINY_MLP,
        "precision=fp32,bf16",
        # The speed trial at the sweep's end times the model in the sweep's own process, apart
        # from the launcher (tests/test_speed.py, tests/test_sweep.py).
        "report.speed_trial=false",
        cwd=tmp_path,
    )
    (sweep_dir,) = (tmp_path / "outputs" / "multirun").glob("*/*")
    for job in ("0", "1"):
        summary = json.loads((sweep_dir / job / "summary.json").read_text())
        assert (summary["status"], summary["world_size"]) == ("completed", 2)
        assert summary["replicas_identical"] is True
        assert (sweep_dir / job / "train.rank1.log").is_file()
    report = json.loads((sweep_dir / "report.json").read_text())
    jobs = {
        row["run"]: (row["precision"], row["status"], row["world_size"]) for row in report["runs"]
    }
    assert jobs == {"0": ("fp32", "completed", 2), "1": ("bf16", "completed", 2)}
    table = (sweep_dir / "report.md").read_text()
    assert "| 0 | mlp | fp32 [2 ranks] |" in table
    assert "| 1 | mlp | bf16 [2 ranks] |" in table
    # submitit's own files: one folder per job, with each task's stdout and stderr.
    assert len(list(sweep_dir.glob(".submitit/*/*_0_log.out"))) == 2
    assert len(list(sweep_dir.glob(".submitit/*/*_1_log.out"))) == 2


@slow
def test_a_job_signalled_before_its_time_limit_is_requeued_and_resumes(tmp_path: Path) -> None:
    """SIGUSR2 while the job trains, as SLURM (or submitit's local controller, ``signal_delay_s``
    before ``timeout_min``) warns a job: caught, a job that ends without a checkpoint, is not
    requeued, or starts over instead of resuming in its own directory."""
    steps, log_every = 200, 20
    marker, sweeps = tmp_path / "training", tmp_path / "sweeps"
    # The first attempt writes the marker at its first step, then needs at least 200 x 0.15 s =
    # 30 s (tests/requeue_pace.py): the signal, sent once the marker is there, finds it training
    # however fast the machine. The controller's own signal would come 5 minutes after a start,
    # never before the job ends; the requeued attempt trains at full speed, in about a second.
    sweep = start_python_m(
        "amp_exp",
        "-m",
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=6",
        "hydra.launcher.signal_delay_s=60",
        "hydra.launcher.max_num_timeout=5",
        "+hydra.callbacks.pace._target_=requeue_pace.SlowFirstAttempt",
        "+hydra.callbacks.pace.seconds_per_step=0.15",
        f"+hydra.callbacks.pace.marker={marker}",
        "precision=fp32",
        *FAST,
        *TINY,
        f"trainer.max_steps={steps}",
        f"trainer.log_every={log_every}",
        # A sweep directory that a requeued job re-resolved would differ by microseconds; this is
        # the default one's resolver, with microseconds.
        f"hydra.sweep.dir={sweeps}/${{amp_exp.launch_time:%H-%M-%S-%f}}",
        env=job_env(),
        timeout=240,
    )
    deadline = time.monotonic() + 180
    while not marker.exists():
        assert sweep.poll() is None and time.monotonic() < deadline, sweep.communicate()
        time.sleep(0.02)
    os.kill(int(marker.read_text()), signal.SIGUSR2)
    _, stderr = sweep.communicate()
    assert sweep.returncode == 0, stderr[-3000:]
    (sweep_dir,) = sweeps.iterdir()
    job_dir = sweep_dir / "0"
    log = "".join(p.read_text() for p in sweep_dir.glob(".submitit/*/*_0_log.*"))
    assert "SIGUSR2 received" in log and "Requeued job" in log, log[-3000:]
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["resumed_from"] == str(job_dir / "checkpoints" / "last.pt")
    assert summary["steps"] == summary["total_steps"] == steps
    assert summary["config"]["resume"] == "auto"
    rows = read_jsonl(job_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == list(range(log_every, steps + 1, log_every))
    assert [r["step"] for r in rows if "eval_acc" in r] == [steps]
    report = json.loads((sweep_dir / "report.json").read_text())
    assert [(row["run"], row["status"]) for row in report["runs"]] == [("0", "completed")]


@slow
def test_a_bad_launcher_option_fails_in_one_line() -> None:
    result = amp_exp("-m", "hydra/launcher=submitit_nope", "precision=fp32,bf16", expect_rc=2)
    assert result.stderr == (
        "amp_exp: error: hydra/launcher=submitit_nope is not an option; valid choices: basic, "
        "joblib, node, slurm, submitit_local, submitit_slurm\n"
    )
