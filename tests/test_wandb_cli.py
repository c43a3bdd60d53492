"""W&B end to end: sweeps, and the fallbacks that keep a run going without a W&B server."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import threading
from datetime import datetime
from pathlib import Path

import pytest

from amp_exp.results.files import REPORT_MD, WANDB_RUN_ID_FILE
from helpers.runs import FAST, OFFLINE_SWEEP_LRS, run_cli
from helpers.wandb_records import read_only_run
from helpers.warm_python import python_m, start_python_m

pytestmark = pytest.mark.slow

# W&B checks a key's shape (40+ characters) before it ever talks to a server.
FAKE_API_KEY = "f00dfeed" * 5
# Nothing listens on the discard port, so every connection is refused.
UNREACHABLE_SERVER = "http://127.0.0.1:9"


def env_without_wandb(home: Path, **extra: str) -> dict[str, str]:
    """This environment without W&B variables, and a home without W&B credentials."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    home.mkdir(parents=True, exist_ok=True)
    return {**env, "HOME": str(home), **extra}


def run_at_terminal(args: list[str], env: dict[str, str], timeout: int) -> tuple[int, str]:
    """Run ``python -m MODULE ARGS`` with a pseudo-terminal for stdin and output, where W&B would
    prompt for a key: forked from the warm interpreter (helpers/warm_python.py), a process of
    its own at the terminal without the seconds a fresh one spends importing torch."""
    python, dash_m, module, *rest = args
    assert (python, dash_m) == (sys.executable, "-m"), args
    controller, terminal = pty.openpty()
    process = start_python_m(module, *rest, env=env, timeout=timeout, terminal=os.ttyname(terminal))
    chunks: list[bytes] = []

    def drain() -> None:
        # A full terminal buffer would block the child, so read while it runs.
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: every process at the terminal has closed it
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        process.communicate()  # its streams are the terminal: nothing of it in the files
        returncode = process.returncode
    except subprocess.TimeoutExpired:  # the warm server killed it at the timeout
        returncode = None
    # Held open until now, so that the terminal stayed up until the child had opened it; once
    # closed, the reader gets all that is left and then EIO.
    os.close(terminal)
    reader.join(timeout=5)
    os.close(controller)
    output = b"".join(chunks).decode(errors="replace")
    assert returncode is not None, f"hung at the terminal:\n{output[-2000:]}"
    return returncode, output


def log_time(line: str) -> datetime:
    # Hydra's log lines start with "[2026-01-31 12:00:00,123]".
    return datetime.strptime(line[1:24], "%Y-%m-%d %H:%M:%S,%f")


def wandb_start_seconds(train_log: str) -> tuple[float, list[str]]:
    """Seconds from the last line before W&B starts to its message, and all W&B lines."""
    lines = train_log.splitlines()
    # The run's first line names its precision (the audit's line later names it too).
    before = next(line for line in lines if "] - precision " in line)
    wandb_lines = [line for line in lines if "W&B" in line]
    return (log_time(wandb_lines[0]) - log_time(before)).total_seconds(), wandb_lines


@pytest.fixture(scope="module")
def offline_wandb_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A three-job learning-rate sweep that logged to W&B offline and asked for a W&B Report;
    read by the tests below. Returns its directory and the command."""
    sweep_dir = tmp_path_factory.mktemp("offline_wandb_sweep")
    result = run_cli(
        "-m",
        *FAST,
        "wandb.mode=offline",
        "report.wandb=true",
        f"optimizer.lr={','.join(OFFLINE_SWEEP_LRS)}",
        f"hydra.sweep.dir={sweep_dir}",
    )
    return sweep_dir, result


def test_a_multirun_gives_each_job_its_own_run_in_one_group(offline_wandb_sweep) -> None:
    sweep_dir, _ = offline_wandb_sweep
    runs = [read_only_run(sweep_dir / str(job)) for job in range(3)]
    assert [run.name for run in runs] == [f"tiny_cnn-fp32-lr{lr}-s0" for lr in OFFLINE_SWEEP_LRS]
    assert {run.group for run in runs} == {str(sweep_dir)}
    lrs = [run.config["optimizer"]["lr"] for run in runs]
    assert lrs == [float(lr) for lr in OFFLINE_SWEEP_LRS]
    assert all([row["_step"] for row in run.history] == [2, 4] for run in runs)
    assert all(run.kinds[-1] == "exit" for run in runs)


def test_a_sweep_that_logged_offline_with_report_wandb_exits_0_and_names_the_command(
    offline_wandb_sweep,
) -> None:
    """(With the test above: one sweep, made once, whichever worker runs this file.)"""
    sweep_dir, result = offline_wandb_sweep
    assert len(list(sweep_dir.glob(f"*/{WANDB_RUN_ID_FILE}"))) == 3
    assert (sweep_dir / REPORT_MD).is_file()
    (line,) = [line for line in result.stdout.splitlines() if "W&B report" in line]
    assert line.endswith(f"`python -m amp_exp.report {sweep_dir} --wandb`")


def test_online_without_a_key_at_a_terminal_falls_back_offline_at_once(tmp_path: Path) -> None:
    out = tmp_path / "run"
    returncode, console = run_at_terminal(
        [sys.executable, "-m", "amp_exp", *FAST, "wandb.mode=online", f"hydra.run.dir={out}"],
        env_without_wandb(tmp_path / "home"),
        timeout=180,
    )
    assert returncode == 0, console[-2000:]
    seconds, wandb_lines = wandb_start_seconds((out / "train.log").read_text())
    assert len(wandb_lines) == 1 and "WARNING" in wandb_lines[0]
    assert "W&B: no API key is configured" in wandb_lines[0]
    assert "logging offline" in wandb_lines[0] and "wandb sync" in wandb_lines[0]
    print(f"fallback after {seconds:.1f} s")
    assert seconds < 10
    # The one message is all the console shows of W&B: no prompt, no W&B output of its own.
    console_wandb = [line for line in console.splitlines() if "W&B" in line or "wandb:" in line]
    assert len(console_wandb) == 1 and "W&B: no API key" in console_wandb[0]
    assert [row["_step"] for row in read_only_run(out).history] == [2, 4]


def test_unreachable_server_falls_back_within_the_timeout_and_keeps_the_key_out(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    env = env_without_wandb(
        tmp_path / "home", WANDB_API_KEY=FAKE_API_KEY, WANDB_BASE_URL=UNREACHABLE_SERVER
    )
    args = [*FAST, "wandb.mode=online", "wandb.init_timeout=1", f"hydra.run.dir={out}"]
    result = python_m("amp_exp", *args, env=env, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    seconds, wandb_lines = wandb_start_seconds((out / "train.log").read_text())
    assert len(wandb_lines) == 1 and "W&B: could not start online" in wandb_lines[0]
    print(f"fallback after {seconds:.1f} s")
    # The bound leaves room for a loaded machine and still tells 1 s from the default 15 s.
    assert 1 <= seconds < 1 + 10
    assert [row["_step"] for row in read_only_run(out).history] == [2, 4]
    files = [path for path in out.rglob("*") if path.is_file()]
    assert any(path.suffix == ".wandb" for path in files) and (out / ".hydra/config.yaml") in files
    leaks = [path for path in files if FAKE_API_KEY.encode() in path.read_bytes()]
    assert leaks == []
