"""The contract every command keeps (amp_exp/results/contract.py), command by command: a
directory holding finished results is refused and left byte for byte, a signal midway exits
128 + N, user code's sys.exit(0) exits 4, a full disk exits 4, a bad value exits 2; each in one
line, with no traceback. Training's own cases live beside its features (test_run_directory,
test_bad_inputs, test_custom, test_cli); the ones here are the commands that came later."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from amp_exp.results.contract import enter
from amp_exp.results.files import SPEED_JSON
from helpers.disks import fill, small_disk
from helpers.runs import FAST, TINY
from helpers.warm_python import python_m
from test_report import write_run

TESTS_DIR = Path(__file__).resolve().parent
CLASSIFIER = ["model=custom", "dataset.image_size=8"]
SPEED = [
    "speed.precisions=[fp32,bf16]",
    "speed.rounds=6",
    "speed.steps=1",
    "speed.max_warmup_steps=10",
]
SENSITIVITY = ["sensitivity.precisions=[bf16]", "sensitivity.batches=1"]
# Each measuring command, as a user runs it on a small classifier.
COMMANDS = {
    "amp_exp.speed": [*FAST, *SPEED],
    "amp_exp.sensitivity": [*FAST, *SENSITIVITY],
    "amp_exp.predict": FAST,
}
RESULT_OF = {
    "amp_exp.speed": SPEED_JSON,
    "amp_exp.sensitivity": "sensitivity.json",
    "amp_exp.predict": "predict.json",
}
# The forward in which user code acts: midway through a measurement, after the one-batch check
# a build runs first; predict traces a single step, so its first.
FORWARD_OF = {"amp_exp.speed": 3, "amp_exp.sensitivity": 3, "amp_exp.predict": 1}


def with_user_code() -> dict[str, str]:
    paths = [str(TESTS_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def with_user_model(command: str, maker: str, when: str, run_dir: Path) -> list[str]:
    """``command``'s arguments for the user model ``maker``, which acts in the forward
    ``FORWARD_OF`` names (its keyword ``when``)."""
    return [
        *COMMANDS[command],
        *CLASSIFIER,
        f"model._target_=helpers.user_code.{maker}",
        f"+model.kwargs.{when}={FORWARD_OF[command]}",
        f"hydra.run.dir={run_dir}",
    ]


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def the_one_error(result) -> str:
    """The one line that says what went wrong; fails on a traceback or a second line."""
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if "error" in line.lower() or "stopped" in line]
    assert len(errors) == 1, output[-3000:]
    return errors[0]


def finished_run(directory: Path) -> None:
    directory.mkdir(parents=True)
    (directory / "summary.json").write_text(json.dumps({"status": "completed", "steps": 4}))
    (directory / "metrics.jsonl").write_text('{"kind": "train", "step": 4, "loss": 1.0}\n')


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_finished_runs_directory_is_refused_and_left_byte_for_byte(
    command, tmp_path, command_main
) -> None:
    """Caught: speed.* added beside a finished run's files with exit 0 (the red team's case)."""
    finished_run(tmp_path / "run")
    before = snapshot(tmp_path / "run")
    result = command_main(command, *COMMANDS[command], f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "holds a completed run (4 steps)" in the_one_error(result)
    assert snapshot(tmp_path / "run") == before


@pytest.mark.slow
def test_a_commands_own_results_are_replaced_only_with_force(tmp_path, command_main) -> None:
    run_dir = tmp_path / "speed"
    run_dir.mkdir()
    (run_dir / SPEED_JSON).write_text('{"trials": []}\n')
    before = snapshot(run_dir)
    # A tiny model's trial: which files are replaced matters here, not what the trial times.
    args = [*COMMANDS["amp_exp.speed"], *TINY, f"hydra.run.dir={run_dir}"]
    refused = command_main("amp_exp.speed", *args)
    assert refused.returncode == 2
    assert "pass --force to replace them" in the_one_error(refused)
    assert snapshot(run_dir) == before
    forced = command_main("amp_exp.speed", "--force", *args)
    assert forced.returncode == 0, forced.stderr[-2000:]
    assert json.loads((run_dir / SPEED_JSON).read_text())["trials"]  # the new trial


def test_a_training_run_refuses_a_directory_holding_a_speed_trial(tmp_path, command_main) -> None:
    run_dir = tmp_path / "speed"
    run_dir.mkdir()
    (run_dir / SPEED_JSON).write_text('{"trials": []}\n')
    result = command_main("amp_exp", *FAST, f"hydra.run.dir={run_dir}")
    assert result.returncode == 2
    assert "finished results of python -m amp_exp.speed (speed.json)" in the_one_error(result)
    assert snapshot(run_dir) == {SPEED_JSON: b'{"trials": []}\n'}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_sigterm_midway_exits_143_and_leaves_no_result(command, tmp_path, command_main) -> None:
    args = with_user_model(command, "make_signalling", "signal_at", tmp_path)
    result = command_main(command, *args)
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-2000:]
    assert the_one_error(result) == f"{command}: stopped by SIGTERM"
    assert not (tmp_path / RESULT_OF[command]).exists()


@pytest.mark.slow
def test_the_process_of_a_signalled_command_exits_143_as_its_main_says(tmp_path) -> None:
    """The tests around read the status ``main`` ends with; this one the process's own, for one
    command. Caught: a status lost on the way out (an atexit hook, a thread that outlives main,
    a signal's default action once the command has let it go)."""
    args = with_user_model("amp_exp.speed", "make_signalling", "signal_at", tmp_path)
    result = python_m("amp_exp.speed", *args, env=with_user_code())
    assert result.returncode == 128 + signal.SIGTERM, result.stderr[-2000:]
    assert the_one_error(result) == "amp_exp.speed: stopped by SIGTERM"
    assert not (tmp_path / SPEED_JSON).exists()


@pytest.mark.parametrize("command", list(COMMANDS))
def test_user_code_calling_sys_exit_0_exits_4(command, tmp_path, command_main) -> None:
    """Caught: exit 0 with no result and no error (the red team's case)."""
    result = command_main(command, *with_user_model(command, "make_exiting", "exit_at", tmp_path))
    assert result.returncode == 4, result.stderr[-2000:]
    assert "raised SystemExit(0)" in the_one_error(result)
    assert not (tmp_path / RESULT_OF[command]).exists()


@pytest.mark.parametrize("command", [*COMMANDS, "amp_exp.report"])
def test_a_full_disk_exits_4_in_one_line(command, tmp_path, command_main) -> None:
    runs = tmp_path / "runs"
    write_run(runs / "0", "tiny_cnn", "fp32", 1000.0, 0.8)
    with small_disk(tmp_path / "disk", 1024) as disk:
        fill(disk, leave_kib=0 if command == "amp_exp.report" else 24)
        if command == "amp_exp.report":
            result = command_main(command, str(runs), "--out", str(disk / "report"))
        else:
            result = command_main(command, *COMMANDS[command], f"hydra.run.dir={disk / 'out'}")
        assert result.returncode == 4, result.stderr[-2000:]
        line = the_one_error(result)
        assert "No space left on device" in line or "KiB free" in line
        assert not (disk / "out").exists()


@pytest.mark.parametrize(
    ("command", "args", "says"),
    [
        ("amp_exp.speed", ["precision=fp9"], "precision=fp9 is not an option"),
        ("amp_exp.sensitivity", ["precision=fp9"], "precision=fp9 is not an option"),
        ("amp_exp.predict", ["predict.devices=[tpu]"], "tpu is not in the device table"),
        ("amp_exp.report", [".", "--tolerance", "nan"], "--tolerance must be a finite number"),
        ("amp_exp.report", [".", "--tolerance", "inf"], "--tolerance must be a finite number"),
        ("amp_exp.report", [".", "--bogus"], "unrecognized arguments: --bogus"),
        ("amp_exp.doctor", ["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    ],
)
def test_a_bad_value_exits_2_in_one_line(command, args, says, tmp_path, monkeypatch, command_main):
    monkeypatch.chdir(tmp_path)
    result = command_main(command, *args)
    assert result.returncode == 2
    assert says in the_one_error(result)
    assert list(tmp_path.iterdir()) == []


def test_a_report_of_fewer_runs_goes_beside_the_sweeps_report(tmp_path, capsys) -> None:
    """Caught: ``report SWEEP/0 SWEEP/0 SWEEP/2`` replacing SWEEP/report.md of 4 runs with a
    report of 2 (the red team's case)."""
    from amp_exp.report.__main__ import main

    for job, precision in enumerate(["fp32", "bf16", "fp32", "bf16"]):
        write_run(tmp_path / str(job), "tiny_cnn", precision, 1000.0, 0.8, seed=job // 2)
    assert main([str(tmp_path)]) == 0
    before = snapshot(tmp_path)
    assert (
        main(
            [str(tmp_path / "0"), str(tmp_path / "0"), str(tmp_path / "1"), "--out", str(tmp_path)]
        )
        == 0
    )
    assert "covers 2 run(s) this report leaves out" in capsys.readouterr().out
    beside = json.loads((tmp_path / "report_2" / "report.json").read_text())
    assert [row["run"] for row in beside["runs"]] == ["../0", "../1"]
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("report_2")} == before
    assert main([str(tmp_path / "0"), str(tmp_path / "1"), "--out", str(tmp_path), "--force"]) == 0
    assert len(json.loads((tmp_path / "report.json").read_text())["runs"]) == 2


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1])
def test_a_signal_stops_a_command_with_128_plus_n_and_one_line(signum, capsys) -> None:
    """The report and doctor have no step to finish: a signal stops them where they are.
    Caught: a traceback (KeyboardInterrupt), or the signal's default (killed, no status)."""
    done = []

    def body() -> None:
        os.kill(os.getpid(), signum)
        done.append("went on")

    assert enter("amp_exp.report", body) == 128 + signum
    assert done == []
    assert capsys.readouterr().err == f"amp_exp.report: stopped by {signal.Signals(signum).name}\n"


def test_a_malformed_sweeper_override_is_one_line():
    """Caught: OmegaConf's AttributeError traceback (the red team's case)."""
    from amp_exp.config.preflight import check_overrides
    from amp_exp.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^hydra\.sweeper\.params: the override's value cannot"):
        check_overrides(["-m", 'hydra.sweeper.params={precision: "fp32", seed: "0,1"}', "seed=1"])


@pytest.mark.slow
def test_a_checkpoint_that_fills_a_real_disk_exits_4_in_one_line(tmp_path, command_main) -> None:
    """Caught: torch's zip writer turning ENOSPC into "RuntimeError: [enforce fail at
    inline_container.cc:672] . unexpected pos", a traceback and exit 1 (the red team's case). A
    ResNet-18's 45 MB checkpoint cannot fit in the 2 MiB left."""
    with small_disk(tmp_path / "disk", 3072) as disk:
        fill(disk, leave_kib=2048)
        run_dir = disk / "run"
        result = command_main(
            "amp_exp",
            *FAST,
            "model=resnet18",
            "dataset.image_size=8",
            "dataset.batch_size=16",
            "trainer.max_steps=1",
            "trainer.eval_every=null",
            f"hydra.run.dir={run_dir}",
        )
        assert result.returncode == 4, result.stderr[-2000:]
        line = the_one_error(result)
        assert line.endswith(
            f"could not write {run_dir}/checkpoints/last.pt (No space left on device); "
            "nothing was written"
        )
        assert not list((run_dir / "checkpoints").glob(".*"))  # no partial file left


def test_ctrl_c_where_the_command_keeps_its_own_signals_is_one_line_and_130(capsys) -> None:
    """``python -m amp_exp`` leaves signals to training; a Ctrl-C in its pre-flight reaches
    Python's own handler. Caught: a KeyboardInterrupt traceback."""

    def body() -> None:
        raise KeyboardInterrupt

    assert enter("amp_exp", body, signals=False) == 130
    assert capsys.readouterr().err == "amp_exp: stopped by SIGINT\n"
