"""The warm interpreter of the CLI tests answers as ``python -m`` would (helpers/warm_python.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.torchrun import torchrun
from helpers.warm_python import python_m, start_python_m

# What a command can see of how it was started, printed one item a line; then exit 3.
REPORTER = """
import json, os, sys
import torch
print(json.dumps(sys.argv[1:]))
print(os.getcwd())
print(sys.path[0], sys.path[1])
print(os.environ.get("AMP_EXP_TEST_VALUE"), torch.get_num_threads())
print(__name__, sys.modules["__main__"].__file__ == __file__)
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


@pytest.mark.slow
def test_a_warm_command_sees_what_a_fresh_python_m_sees(tmp_path: Path) -> None:
    modules, workdir = tmp_path / "modules", tmp_path / "work"
    modules.mkdir()
    workdir.mkdir()
    (modules / "reporter.py").write_text(REPORTER)
    env = {
        **os.environ,
        "PYTHONPATH": str(modules),
        "OMP_NUM_THREADS": "1",
        "AMP_EXP_TEST_VALUE": "from the test",
    }
    args = ("a b", "--flag", "key=value")
    fresh = subprocess.run(
        [sys.executable, "-m", "reporter", *args],
        capture_output=True,
        text=True,
        cwd=workdir,
        env=env,
        timeout=120,
    )
    warm = python_m("reporter", *args, cwd=workdir, env=env, timeout=120)
    assert (warm.returncode, warm.stdout, warm.stderr) == (3, fresh.stdout, fresh.stderr)
    assert fresh.stdout.splitlines()[-2:] == ["from the test 1", "__main__ True"]


def test_a_warm_command_that_outlives_its_timeout_is_killed(tmp_path: Path) -> None:
    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    with pytest.raises(subprocess.TimeoutExpired):
        python_m("sleeper", env=env, timeout=0.5)
    assert python_m("json.tool", "--help").returncode == 0  # the server serves on


# Says it is ready, then waits for SIGTERM, which it answers by exiting 7 after a last line.
WAITER = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (print("terminated"), sys.exit(7)))
print("waiting", flush=True)
time.sleep(60)
"""


def test_a_started_warm_command_is_signalled_by_its_pid_and_reports_as_popen_would(
    tmp_path: Path,
) -> None:
    """Caught: the signal sent to the server instead of the command, poll() blind to an exit
    the server already answered, or a command killed by a signal reported as an exit status."""
    (tmp_path / "waiter.py").write_text(WAITER)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    started = start_python_m("waiter", env=env, timeout=120)
    deadline = time.monotonic() + 60
    while "waiting" not in started.read_stdout():
        assert started.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    started.send_signal(signal.SIGTERM)
    assert started.communicate() == ("waiting\nterminated\n", "")
    assert started.returncode == 7 and started.poll() == 7
    killed = start_python_m("waiter", env=env, timeout=120)
    killed.send_signal(signal.SIGKILL)
    while killed.poll() is None:
        time.sleep(0.02)
    assert killed.returncode == -signal.SIGKILL


# One rank's view of how it was started, written to OUTPUT/rank<RANK>.json; then a line to
# stdout left unflushed by os._exit, which only unbuffered streams (python -u) still deliver.
RANK_REPORTER = """
import json, os, sys
from pathlib import Path
import torch
rank = os.environ["RANK"]
seen = {
    "argv": sys.argv,
    "path0": sys.path[0],
    "ranks": [os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]],
    "main": __name__,
    "threads": torch.get_num_threads(),
    "env": sorted(key for key in os.environ if key.startswith("AMP_EXP_TEST")),
}
Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(seen))
print(f"rank {rank} done")
os._exit(0)
"""


@pytest.mark.slow
def test_a_warm_rank_sees_what_torchrun_s_python_u_would_show_it(tmp_path: Path) -> None:
    """Caught: a warm rank that runs from the wrong folder or path, misses torchrun's
    variables, keeps the zygote's socket in its environment, loses output at os._exit, or
    keeps the server's thread count (helpers/warm_rank.py)."""
    script = tmp_path / "scripts" / "reporter.py"
    script.parent.mkdir()
    script.write_text(RANK_REPORTER)
    result = torchrun(str(script), str(tmp_path))
    assert sorted(line for line in result.stdout.splitlines() if "done" in line) == [
        "rank 0 done",
        "rank 1 done",
    ]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {
            "argv": [str(script), str(tmp_path)],
            "path0": str(script.parent),
            "ranks": [str(rank), "2"],
            "main": "__main__",
            "threads": 1,
            "env": [],
        }
