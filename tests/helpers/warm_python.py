"""``python -m MODULE ARGS`` for tests, from an interpreter that has already imported torch.

Every ``python -m amp_exp`` pays about 5 s of CPU to import torch (and torch._dynamo, which the
first optimizer imports) before it does anything; a test suite that starts forty of them spends
minutes there. This module is also a small server: started once per test session, it imports
the heavy third-party packages, then forks one child per command. The child becomes what
``python -m`` would have started (working directory, environment, ``sys.path`` with PYTHONPATH,
``sys.argv``, standard streams) and runs the module with :func:`runpy.run_module`, exactly as
``-m`` does. amp_exp itself is imported afresh in every child, so its import-time behaviour
(config registration, warnings, errors) is real; only third-party imports are shared.

Use :func:`python_m` where a test wants a command's exit status, output and files. Tests that
signal a process from outside or give it a terminal start a fresh one, and the processes a
command starts itself (torchrun's ranks, submitit's tasks, the benchmark's parity sides) are
fresh as always.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Third-party only: importing them reads no environment that a test varies.
PRELOAD = (
    "numpy",
    "torch",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint.state_dict",
    "torchvision",
    "hydra",
    "hydra._internal.utils",
    "hydra._internal.hydra",
    "omegaconf",
)
# The server's own PYTHONPATH entries, which a child with another PYTHONPATH must not keep.
_SERVER_PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


# --- the server (runs in its own process) ---------------------------------------------------------


def _interpreter_path(pythonpath: str | None) -> list[str]:
    """``sys.path`` as a fresh ``python -m`` started in the current directory would have it."""
    base = [p for p in sys.path[1:] if p not in _SERVER_PYTHONPATH]
    extra = [p for p in (pythonpath or "").split(os.pathsep) if p]
    return [os.getcwd(), *extra, *base]


def _become_the_command(request: dict) -> None:
    """In the forked child: take on the command's directory, environment, streams and argv."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in (
        (0, request["stdin"], os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY),
        (2, request["stderr"], os.O_WRONLY),
    ):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    sys.path[:] = _interpreter_path(request["env"].get("PYTHONPATH"))
    sys.argv = [request["module"], *request["args"]]
    threads = request["env"].get("OMP_NUM_THREADS")
    if threads:
        # torch read OMP_NUM_THREADS when the server imported it; a fresh process reads it now.
        import torch

        torch.set_num_threads(int(threads))


def _serve() -> None:
    for module in PRELOAD:
        __import__(module)
    # Signal dispositions stay the server's, which it inherited from the test process as any
    # subprocess would (SIGINT stays ignored when the suite runs as a background job).
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _become_the_command(request)
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            sys.exit(0)
        print(json.dumps({"returncode": _wait(pid, request["timeout"])}), flush=True)


def _wait(pid: int, timeout: float) -> int | None:
    """The child's exit status as subprocess reports it, or None after killing it at timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


# --- the client (runs in the test process) --------------------------------------------------------


class _Server:
    def __init__(self) -> None:
        log_fd, log_path = tempfile.mkstemp(prefix="warm_python_", suffix=".log")
        self.log = Path(log_path)
        self.process = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log_fd,
            text=True,
        )
        os.close(log_fd)
        self._expect("ready")
        atexit.register(self.close)

    def _expect(self, what: str) -> str:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"warm python server died: {self.log.read_text()[-2000:]}")
        if what and line.strip() != what:
            raise RuntimeError(f"warm python server said {line!r}, not {what!r}")
        return line

    def run(self, request: dict) -> int | None:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return json.loads(self._expect(""))["returncode"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)
        self.log.unlink(missing_ok=True)


_server: _Server | None = None


def python_m(
    module: str,
    *args: str,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    input: str | None = None,
) -> subprocess.CompletedProcess:
    """What ``subprocess.run([python, "-m", module, *args], capture_output=True, text=True,
    input=input)`` returns, from a forked warm interpreter; raises
    ``subprocess.TimeoutExpired`` as it would. Without ``input`` the command reads an empty
    stdin."""
    global _server
    if _server is None or _server.process.poll() is not None:
        _server = _Server()
    with tempfile.TemporaryDirectory(prefix="python_m_") as streams:
        out, err = Path(streams, "stdout"), Path(streams, "stderr")
        out.touch()
        err.touch()
        stdin = os.devnull
        if input is not None:
            stdin = Path(streams, "stdin")
            stdin.write_text(input)
        returncode = _server.run(
            {
                "module": module,
                "args": list(args),
                "cwd": str(cwd or os.getcwd()),
                "env": dict(os.environ if env is None else env),
                "stdout": str(out),
                "stderr": str(err),
                "stdin": str(stdin),
                "timeout": timeout,
            }
        )
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
    command = [sys.executable, "-m", module, *args]
    if returncode is None:
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    return subprocess.CompletedProcess(command, returncode, stdout, stderr)


if __name__ == "__main__":
    _serve()
