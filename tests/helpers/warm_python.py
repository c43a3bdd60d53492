"""``python -m MODULE ARGS`` for tests, from an interpreter that has already imported torch.

Every ``python -m amp_exp`` pays about 5 s of CPU to import torch (and torch._dynamo, which the
first optimizer imports) before it does anything; a test suite that starts forty of them spends
minutes there. This module is also a small server: started once per test session, it imports
the heavy third-party packages, then forks one child per command. The child becomes what
``python -m`` would have started (working directory, environment, ``sys.path`` with PYTHONPATH,
``sys.argv``, standard streams) and runs the module with :func:`runpy.run_module`, exactly as
``-m`` does. amp_exp itself is imported afresh in every child, so its import-time behaviour
(config registration, warnings, errors) is real; only third-party imports are shared.

Use :func:`python_m` where a test wants a command's exit status, output and files, and
:func:`start_python_m` where it signals the command while it runs (the child's pid is the
command's), and with a pseudo-terminal for its streams where a test wants one. The processes a
command starts itself (submitit's tasks, the benchmark's parity sides) are fresh as always, but
for torchrun's ranks under helpers/torchrun.py: a second process forked at the server's start, the
rank zygote, forks each of them for helpers/warm_rank.py, which torchrun runs in place of
``python -u``.
"""

from __future__ import annotations

import atexit
import ctypes
import io
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

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
    "scipy.stats",
)
# The rank zygote's socket, in the environment of the ranks' torchrun (helpers/warm_rank.py).
RANKS_ENV = "AMP_EXP_TEST_WARM_RANKS"
PR_SET_PDEATHSIG = 1  # prctl(2)
# The server's own PYTHONPATH entries, which a child with another PYTHONPATH must not keep.
_SERVER_PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


# --- the server (runs in its own process) ---------------------------------------------------------


def _take_on(cwd: str, env: dict[str, str], argv: list[str], path0: str | None = None) -> None:
    """In a forked child: the directory, environment, ``sys.path`` and ``sys.argv`` of a fresh
    interpreter started in ``cwd`` with ``env`` (``path0``: the first entry of its path, the
    script's folder; the directory for ``-m``)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    base = [p for p in sys.path[1:] if p not in _SERVER_PYTHONPATH]
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [path0 or os.getcwd(), *extra, *base]
    sys.argv = argv
    threads = env.get("OMP_NUM_THREADS")
    if threads:
        # torch read OMP_NUM_THREADS when the server imported it; a fresh process reads it now.
        import torch

        torch.set_num_threads(int(threads))


def _become_the_command(request: dict) -> None:
    """In the forked child: take on the command's directory, environment, streams and argv."""
    if request["new_session"]:
        os.setsid()  # as Popen(start_new_session=True): the test signals the command's group
    for fd, path, flags in (
        (0, request["stdin"], os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY),
        (2, request["stderr"], os.O_WRONLY),
    ):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    _take_on(request["cwd"], request["env"], [request["module"], *request["args"]])


def _serve(rank_socket: str) -> None:
    for module in PRELOAD:
        __import__(module)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(rank_socket)
    listener.listen()
    if os.fork() == 0:
        _serve_ranks(listener)
    listener.close()
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
        print(json.dumps({"pid": pid}), flush=True)
        print(json.dumps({"returncode": _wait(pid, request["timeout"])}), flush=True)


# --- the rank zygote (a process of its own, forked by the server) -------------------------------


def _serve_ranks(listener: socket.socket) -> NoReturn:
    """Fork a rank for each helpers/warm_rank.py that connects: torchrun started that script in
    place of ``python -u``, and it hands over its command, environment and standard streams."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # gone with the server, whatever ends it
    # Off the server's request and answer pipes, which the client watches for the server's end.
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # each rank's keeper reaps itself
    while True:
        connection, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _keep_rank(connection)
        connection.close()


def _keep_rank(connection: socket.socket) -> NoReturn:
    """Fork the rank, tell the waiting script its pid, then its wait status when it ends."""
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    request = json.loads(message)
    pid = os.fork()
    if pid == 0:
        connection.close()
        _become_the_rank(request, fds)
        argv = request["argv"]
        if argv[0] == "-m":
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
        sys.exit(0)
    for fd in fds:
        os.close(fd)
    connection.send(json.dumps({"pid": pid}).encode())
    _, status = os.waitpid(pid, 0)
    connection.send(json.dumps({"status": status}).encode())
    os._exit(0)


def _become_the_rank(request: dict, fds: list[int]) -> None:
    """In the forked rank: what ``python -u ARGV`` would be, started where the script was."""
    for fd, received in enumerate(fds):
        os.dup2(received, fd)
        os.close(received)
    # As -u: every write reaches the stream at once, even from a rank that ends in os._exit.
    for name, fd in (("stdout", 1), ("stderr", 2)):
        raw = open(fd, "wb", buffering=0, closefd=False)  # noqa: SIM115
        errors = "backslashreplace" if name == "stderr" else "strict"
        setattr(sys, name, io.TextIOWrapper(raw, write_through=True, errors=errors))
    argv, cwd = request["argv"], request["cwd"]
    if argv[0] == "-m":
        _take_on(cwd, request["env"], argv[1:])
    else:
        script = os.path.join(cwd, argv[0])
        _take_on(cwd, request["env"], argv, os.path.dirname(os.path.abspath(script)))


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
        self.sockets = tempfile.TemporaryDirectory(prefix="warm_ranks_")
        self.ranks = str(Path(self.sockets.name, "ranks.sock"))
        self.process = subprocess.Popen(
            [sys.executable, __file__, self.ranks],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log_fd,
            text=True,
        )
        os.close(log_fd)
        # Unbuffered: a line is read up to its newline and no further, so that select() sees
        # an answer still to come (a buffered reader may hold the pid and the status at once).
        self.answers = open(self.process.stdout.fileno(), "rb", buffering=0, closefd=False)  # noqa: SIM115
        self._expect("ready")
        atexit.register(self.close)

    def _expect(self, what: str) -> str:
        line = self.answers.readline().decode()
        if not line:
            raise RuntimeError(f"warm python server died: {self.log.read_text()[-2000:]}")
        if what and line.strip() != what:
            raise RuntimeError(f"warm python server said {line!r}, not {what!r}")
        return line

    def start(self, request: dict) -> int:
        """Fork the command; its pid."""
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return json.loads(self._expect(""))["pid"]

    def answered(self) -> bool:
        """Whether the running command's exit status is waiting to be read (it has ended)."""
        return bool(select.select([self.answers], [], [], 0)[0])

    def returncode(self) -> int | None:
        """The running command's exit status once it ends; None if the server killed it at its
        timeout."""
        return json.loads(self._expect(""))["returncode"]

    def close(self) -> None:
        self.answers.close()
        self.process.stdin.close()
        self.process.wait(timeout=30)
        self.log.unlink(missing_ok=True)
        self.sockets.cleanup()


_server: _Server | None = None


def _running_server() -> _Server:
    global _server
    if _server is None or _server.process.poll() is not None:
        _server = _Server()
    return _server


def rank_socket() -> str:
    """Where the warm server forks torchrun's ranks: ``RANKS_ENV`` in torchrun's environment,
    read by helpers/warm_rank.py."""
    return _running_server().ranks


class WarmProcess:
    """A command forked by the server, as far as a test that signals it needs ``Popen``:
    ``pid``, ``send_signal``, ``poll``, ``wait``, and ``communicate`` for its streams, which are
    files (``read_stdout`` reads what it has written so far). One at a time: the server serves
    the next command once this one has ended."""

    def __init__(self, module: str, args: tuple[str, ...], request: dict, input: str | None):
        self._server, self.args = _running_server(), [sys.executable, "-m", module, *args]
        self._timeout = request["timeout"]
        self._streams = tempfile.TemporaryDirectory(prefix="python_m_")
        folder = Path(self._streams.name)
        self._out, self._err = folder / "stdout", folder / "stderr"
        self._out.touch()
        self._err.touch()
        stdin = os.devnull
        if input is not None:
            stdin = folder / "stdin"
            stdin.write_text(input)
        self.returncode: int | None = None
        self._ended = False
        self._output: tuple[str, str] | None = None
        streams = {"stdout": str(self._out), "stderr": str(self._err), "stdin": str(stdin)}
        if request.get("terminal"):  # all three streams at the terminal, as a shell starts it
            streams = dict.fromkeys(streams, request["terminal"])
        self.pid = self._server.start({**request, **streams})

    def send_signal(self, signum: int) -> None:
        if not self._ended:
            os.kill(self.pid, signum)

    def poll(self) -> int | None:
        if not self._ended and self._server.answered():
            self._end()
        return self.returncode

    def wait(self) -> int:
        if not self._ended:
            self._end()
        return self.returncode

    def _end(self) -> None:
        self.returncode, self._ended = self._server.returncode(), True
        if self.returncode is None:
            stdout, stderr = self.communicate()
            raise subprocess.TimeoutExpired(self.args, self._timeout, stdout, stderr)

    def read_stdout(self) -> str:
        """What the command has written to its stdout so far."""
        return self._out.read_text(errors="replace")

    def communicate(self) -> tuple[str, str]:
        """Wait for the command to end (the server kills it at its timeout); its stdout and
        stderr."""
        if not self._ended:
            self._end()
        if self._output is None:
            self._output = self.read_stdout(), self._err.read_text(errors="replace")
            self._streams.cleanup()
        return self._output


def start_python_m(
    module: str,
    *args: str,
    cwd: Path | str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    input: str | None = None,
    start_new_session: bool = False,
    terminal: str | None = None,
) -> WarmProcess:
    """``python -m module args`` forked from the warm interpreter and left running, as
    ``subprocess.Popen`` starts it; the server kills it after ``timeout`` seconds (``wait`` then
    raises ``subprocess.TimeoutExpired``). Without ``input`` the command reads an empty
    stdin. ``terminal``: the path of a pseudo-terminal (``os.ttyname``) for its stdin, stdout
    and stderr instead, which the caller reads."""
    request = {
        "module": module,
        "args": list(args),
        "cwd": str(cwd or os.getcwd()),
        "env": dict(os.environ if env is None else env),
        "timeout": timeout,
        "new_session": start_new_session,
        "terminal": terminal,
    }
    return WarmProcess(module, args, request, input)


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
    started = start_python_m(module, *args, cwd=cwd, env=env, timeout=timeout, input=input)
    stdout, stderr = started.communicate()
    return subprocess.CompletedProcess(started.args, started.returncode, stdout, stderr)


if __name__ == "__main__":
    _serve(sys.argv[1])
