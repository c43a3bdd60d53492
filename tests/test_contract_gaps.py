"""The contract's gaps the red team found (issue 43, "The contract everywhere"), each as the
case that failed: the report into a directory in use, the speed command into a sweep's
directory, a plugin that raises, a bad WORLD_SIZE, SIGTERM during a sweep's speed trial, a
plugin under a built-in's name, a plugin whose state no checkpoint keeps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from amp_exp.config import precisions
from amp_exp.errors import ConfigError, RuntimeFault
from amp_exp.results.contract import enter, stop_on_signals
from amp_exp.results.files import SPEED_JSON
from amp_exp.run import train
from helpers.disks import small_disk
from helpers.runs import FAST, TINY
from helpers.warm_python import start_python_m
from test_contract import SPEED, snapshot
from test_report import write_run
from test_speed import sweep_start

ROOT = Path(__file__).resolve().parent.parent
# The reports here are read for their exit statuses and words, not their PNGs (conftest).
pytestmark = pytest.mark.usefixtures("pngs_not_rasterized")

# A bf16 plugin that fails where its options say: in one of its hooks, or with a state that no
# checkpoint can keep (its own subclass of the built-in, as a user would write it).
FAULTY = '''
"""faulty: bf16 that raises in the hook precision.options.fail_in names."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from amp_exp.training.precisions.bf16 import Bf16


@dataclass
class Options:
    fail_in: str = ""
    # What state_dict() returns: "plain", "object" (a class a safe load refuses), "lambda".
    state: str = "plain"


class Opaque:
    pass


class Faulty(Bf16):
    Options = Options
    spec = dataclasses.replace(
        Bf16.spec, name="faulty", order=12, colour="#654321", auto_candidate=False
    )

    def fail(self, hook):
        if self.options.fail_in == hook:
            raise ValueError(f"boom in {hook}")

    def convert_module(self, model):
        self.fail("convert_module")
        return super().convert_module(model)

    def forward_context(self):
        self.fail("forward_context")
        return super().forward_context()

    def backward(self, loss):
        self.fail("backward")
        super().backward(loss)

    def optimizer_step(self, optimizer):
        self.fail("optimizer_step")
        super().optimizer_step(optimizer)

    def state_dict(self):
        self.fail("state_dict")
        return {"plain": {"steps": 1}, "object": {"kept": Opaque()}, "lambda": {"f": lambda: 1}}[
            self.options.state
        ]
'''
FAULTY_PLUGIN = ["precision._target_=faulty_precision.Faulty", "precision.name=faulty"]
TINY_RUN = [*TINY, "trainer.max_steps=2", "trainer.eval_every=null"]

# A plugin that takes bf16's name, as an installed package or precision._target_ would bring it.
IMPOSTOR = """
import dataclasses

from amp_exp.training.precisions.bf16 import Bf16


class Impostor(Bf16):
    spec = dataclasses.replace(Bf16.spec, colour="#000000")
"""


@pytest.fixture
def user_plugins(tmp_path, monkeypatch) -> Path:
    """Both plugin modules on sys.path, and a registry that starts empty, as in a fresh process,
    and forgets them after the test."""
    package = tmp_path / "package"
    package.mkdir()
    (package / "faulty_precision.py").write_text(textwrap.dedent(FAULTY))
    (package / "impostor_precision.py").write_text(textwrap.dedent(IMPOSTOR))
    monkeypatch.syspath_prepend(str(package))
    monkeypatch.setattr(precisions, "_plugins", {})
    monkeypatch.setattr(precisions, "_found", set())
    return package


# -- 1. python -m amp_exp.report holds the directory it writes into, and only that one --------


def test_a_report_into_a_directory_in_use_is_refused_with_exit_2(
    tmp_path, capsys, lock_elsewhere
) -> None:
    """Caught: two reports (or a report and a run) writing report.md into one directory at once,
    each exit 0 (the report took no lock)."""
    from amp_exp.report.__main__ import main

    write_run(tmp_path / "runs" / "0", "tiny_cnn", "fp32", 1000.0, 0.8)
    out = tmp_path / "out"
    out.mkdir()
    holder = lock_elsewhere.hold(out)
    try:
        assert main([str(tmp_path / "runs"), "--out", str(out)]) == 2
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    err = capsys.readouterr().err
    assert err.startswith(f"amp_exp.report: error: {out} is in use by pid {holder.pid} on ")
    assert err.endswith("; wait for it, or write the report elsewhere with --out DIR\n")
    assert len(err.splitlines()) == 1
    assert not (out / "report.md").exists()


def remount_read_only(disk: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)


def test_a_read_only_directory_is_read_without_a_claim(tmp_path, capsys) -> None:
    """The runs are read where they lie; only --out is held. Caught: a lock file taken in every
    directory read, which a read-only (or shared) results folder refuses."""
    from amp_exp.report.__main__ import main

    with small_disk(tmp_path / "disk", 2048) as disk:
        for job, precision in enumerate(["fp32", "bf16"]):
            write_run(disk / "runs" / str(job), "tiny_cnn", precision, 1000.0, 0.8)
        remount_read_only(disk)
        assert main([str(disk / "runs"), "--out", str(tmp_path / "out")]) == 0
        assert (tmp_path / "out" / "report.md").is_file()
        assert (tmp_path / "out" / ".amp_exp.lock").is_file()
        # Into the read-only folder itself: one line that says where else to write it.
        capsys.readouterr()
        assert main([str(disk / "runs")]) == 4
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.rstrip().endswith(
            "write it elsewhere with --out DIR"
        )


# -- 2. python -m amp_exp.speed refuses a sweep's directory --------------------------------------


def test_the_speed_command_refuses_a_finished_sweeps_directory(
    tmp_path, monkeypatch, capsys
) -> None:
    """Caught: speed.json, speed.md and speed.log written among a finished sweep's jobs and
    report with exit 0 (the red team's case); --force replaces only the command's own."""
    from amp_exp.speed.__main__ import main

    sweep = tmp_path / "sweep"
    for job, precision in enumerate(["fp32", "bf16"]):
        write_run(sweep / str(job), "tiny_cnn", precision, 1000.0, 0.8)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    (sweep / "report.md").write_text("# the sweep's report\n")
    before = snapshot(sweep)
    for force in ([], ["--force"]):
        monkeypatch.setattr(
            sys, "argv", ["amp_exp.speed", *force, *FAST, *SPEED, f"hydra.run.dir={sweep}"]
        )
        with pytest.raises(SystemExit) as exited:
            main()
        assert exited.value.code == 2
        assert capsys.readouterr().err == (
            f"amp_exp.speed: error: {sweep} holds a sweep's results (multirun.yaml); python -m "
            "amp_exp.speed would mix its files with them: give it its own directory "
            "(hydra.run.dir=...)\n"
        )
        assert snapshot(sweep) == before


# -- 3. a plugin that raises is exit 4 in one line naming it --------------------------------------


@pytest.mark.parametrize(
    "hook", ["convert_module", "forward_context", "backward", "optimizer_step", "state_dict"]
)
def test_a_plugin_that_raises_is_a_runtime_fault_naming_it(
    hook, user_plugins, run_cfg, tmp_path
) -> None:
    """Caught: the plugin's ValueError as a traceback with exit 1, which names no plugin."""
    cfg = run_cfg(*TINY_RUN, *FAULTY_PLUGIN, f"+precision.options.fail_in={hook}")
    with pytest.raises(RuntimeFault) as fault:
        train(cfg, tmp_path)
    assert str(fault.value) == (
        f"precision plugin Faulty (faulty_precision) raised ValueError in {hook}: boom in {hook}"
    )
    assert fault.value.exit_status == 4


def test_what_the_model_raises_inside_the_plugins_context_is_not_the_plugins(
    user_plugins, run_cfg, tmp_path
) -> None:
    """The model's own error passes through the plugin's forward context as it is. Caught:
    every error under autocast blamed on the precision."""
    cfg = run_cfg(
        *FAULTY_PLUGIN,
        "trainer.max_steps=2",
        "dataset.image_size=8",
        "model=custom",
        "model._target_=helpers.user_code.make_failing",
        "+model.kwargs.fail_at=3",
    )
    with pytest.raises(ValueError, match=r"^the model's own bug$"):
        train(cfg, tmp_path)


# -- 4. a bad WORLD_SIZE is exit 2 in one line ---------------------------------------------------


@pytest.mark.parametrize(
    ("environment", "says"),
    [
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not a whole number"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be 1 or more"),
        ({"WORLD_SIZE": "-1"}, "WORLD_SIZE=-1 must be 1 or more"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 must lie in 0 to 1 (WORLD_SIZE=2)"),
        ({"WORLD_SIZE": "2", "RANK": "-1"}, "RANK=-1 must lie in 0 to 1 (WORLD_SIZE=2)"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not a whole"),
    ],
)
def test_a_bad_world_size_exits_2_in_one_line_and_writes_nothing(
    environment, says, tmp_path, monkeypatch, capsys
) -> None:
    """Caught: int()'s ValueError traceback with exit 1, and 0 or -1 training alone, exit 0."""
    from amp_exp.__main__ import launch_run

    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", ["amp_exp", *FAST, f"hydra.run.dir={tmp_path / 'run'}"])
    assert enter("amp_exp", launch_run, signals=False) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"amp_exp: error: {says}") and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


# -- 5. SIGTERM during a sweep's speed trial: the rounds measured are reported, then 143 ---------


def signal_at_round(monkeypatch, calls: int) -> None:
    """SIGTERM to this process once the ``calls``-th side of a round has been timed: the round
    is cut short between its two sides."""
    import amp_exp.speed.trial as trial_module

    timed = []
    real = trial_module.Side.time_round

    def time_round(side, clock, steps):
        real(side, clock, steps)
        timed.append(1)
        if len(timed) == calls:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(trial_module.Side, "time_round", time_round)


TRIAL = [
    *TINY,
    "dataset.batch_size=4",
    "speed.rounds=6",
    "speed.max_rounds=20",
    "speed.steps=2",
    "speed.max_warmup_steps=10",
    "speed.target_halfwidth=1e-9",
]


def test_sigterm_stops_the_trial_keeping_the_whole_rounds_it_timed(run_cfg, monkeypatch):
    """Caught: the trial's measurements lost to SIGTERM's default action. The 9th side is the
    5th round's first: 4 whole rounds (the fewest a speedup is fitted to) are kept, and the pair
    after it is not timed."""
    from amp_exp.speed.__main__ import candidates
    from amp_exp.speed.trial import TrialStopped, run_trial, trial_markdown

    cfg = run_cfg(*TRIAL, "speed.precisions=[bf16,bf16_true]")
    signal_at_round(monkeypatch, 9)
    with pytest.raises(TrialStopped) as stopped, stop_on_signals():
        run_trial(candidates(cfg), cfg.speed)
    assert stopped.value.received == signal.SIGTERM
    trial = stopped.value.trial
    assert trial["stopped_by"] == "SIGTERM"
    pair = trial["pairs"]["bf16"]
    assert len(pair["order"]) == 4
    assert [len(times) for times in pair["ms_per_step"].values()] == [4, 4]
    speedup = trial["speedup"]["bf16"]
    assert (speedup["rounds"], speedup["stopped_by"]) == (4, "SIGTERM")
    assert trial["not_timed"] == {"bf16_true": "stopped by SIGTERM before its turn"}
    assert "**Partial: SIGTERM stopped this trial.**" in trial_markdown([trial])
    assert "4 AB/BA rounds; partial: stopped by SIGTERM" in trial_markdown([trial])


def test_sigterm_in_a_sweeps_trial_writes_its_report_then_stops_the_sweep(
    run_cfg, monkeypatch, tmp_path
) -> None:
    """The sweep's callback: speed.json and the report show the rounds measured, marked as
    partial, and the signal then stops the sweep (Stopped: the command exits 143)."""
    from amp_exp.report.assemble import SweepReport
    from amp_exp.speed.sweep import time_sweep
    from amp_exp.speed.trial import TrialStopped

    for job, precision in enumerate(["fp32", "bf16"]):
        train(run_cfg(*TRIAL, "trainer.max_steps=2", f"precision={precision}"), tmp_path / str(job))
    callback = SweepReport(speed_trial=time_sweep)
    sweep_start(callback, tmp_path, "hydra._internal.core_plugins.basic_launcher.BasicLauncher")
    signal_at_round(monkeypatch, 9)
    with pytest.raises(TrialStopped):
        callback.build()
    (trial,) = json.loads((tmp_path / SPEED_JSON).read_text())["trials"]
    assert trial["stopped_by"] == "SIGTERM" and trial["speedup"]["bf16"]["rounds"] == 4
    assert "4 AB/BA rounds; partial: stopped by SIGTERM" in (tmp_path / "report.md").read_text()
    # The handler of the trial is gone: the sweep's process has its own back.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.slow
def test_a_sweep_sigtermed_in_its_speed_trial_exits_143_with_its_report(tmp_path) -> None:
    """Caught: the sweep killed by SIGTERM's default action, with no speed.json and no report."""
    sweep = tmp_path / "sweep"
    sweep_run = start_python_m(
        "amp_exp",
        "-m",
        "precision=fp32,bf16",
        *FAST,
        *TRIAL,
        "trainer.max_steps=2",
        "speed.max_rounds=100000",
        f"hydra.sweep.dir={sweep}",
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    deadline = time.monotonic() + 240
    # A progress line with an interval: the trial is 4 rounds or more into its rounds.
    while "] so far" not in sweep_run.read_stdout():
        assert sweep_run.poll() is None and time.monotonic() < deadline, sweep_run.read_stdout()
        time.sleep(0.05)
    sweep_run.send_signal(signal.SIGTERM)
    stdout, stderr = sweep_run.communicate()
    assert sweep_run.returncode == 128 + signal.SIGTERM, (stdout + stderr)[-3000:]
    assert stderr.strip().splitlines()[-1] == "amp_exp: stopped by SIGTERM"
    (trial,) = json.loads((sweep / SPEED_JSON).read_text())["trials"]
    assert trial["stopped_by"] == "SIGTERM"
    assert "stopped by SIGTERM" in (sweep / "report.md").read_text()


# -- 6. a plugin under a built-in's name is refused ----------------------------------------------


def test_a_target_plugin_under_a_built_in_name_is_refused_in_one_line(user_plugins) -> None:
    """Caught, in a fresh process: the impostor registered as bf16, and the refusal (once the
    built-ins loaded) blaming amp_exp's own bf16 for taking the impostor's name."""
    with pytest.raises(ConfigError) as refused:
        precisions.register("impostor_precision.Impostor")
    assert str(refused.value) == (
        "precision._target_=impostor_precision.Impostor takes the name 'bf16' of a built-in "
        "precision; give it a name of its own (its spec.name, and its entry point's name)"
    )


@pytest.mark.parametrize("entry_name", ["bf16", "impostor"])
def test_an_installed_plugin_under_a_built_in_name_is_refused(entry_name, user_plugins) -> None:
    """Caught: precision=bf16 silently running amp_exp's bf16, the installed package that
    claims the name never loaded (the built-in was found first)."""
    info = user_plugins / "impostor_precision-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: impostor-precision\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(
        f"[amp_exp.precisions]\n{entry_name} = impostor_precision:Impostor\n"
    )
    with pytest.raises(ConfigError, match=rf"^entry point {entry_name} \(impostor_precision:"):
        precisions.get("bf16")


# -- 7. a plugin's state that no checkpoint keeps is caught at the first checkpoint --------------


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        ("object", "it holds a faulty_precision.Opaque"),
        ("lambda", "Can't pickle"),
    ],
)
def test_a_plugin_state_no_checkpoint_keeps_fails_the_first_save(
    state, reason, user_plugins, run_cfg, tmp_path
) -> None:
    """Caught: a class in the state saved with exit 0, and only the resume finding that no
    checkpoint loads; a lambda as a PicklingError traceback."""
    cfg = run_cfg(
        *TINY_RUN, *FAULTY_PLUGIN, f"+precision.options.state={state}", "checkpoint.every_steps=1"
    )
    with pytest.raises(RuntimeFault) as fault:
        train(cfg, tmp_path)
    message = str(fault.value)
    assert message.startswith(
        "the state_dict() of precision plugin Faulty (faulty_precision) cannot be checkpointed "
        "so that it loads back ("
    )
    assert reason in message and len(message.splitlines()) == 1
    assert not list((tmp_path / "checkpoints").glob("*.pt"))
