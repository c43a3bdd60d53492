"""One rank of a torchrun test job, forked from the warm interpreter (helpers/warm_python.py).

torchrun starts ``python -I -S warm_rank.py ARGV`` (``--no-python``) where it would start
``python -u ARGV``; this script, which imports only the standard library, hands its command
line, environment and standard streams to the warm server's rank zygote, which forks the rank
with torch already imported. It passes on every signal torchrun sends it and ends as the rank
ended (its exit status, or killed by the same signal), so the agent sees the rank as its own."""

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys

RANKS_ENV = "AMP_EXP_TEST_WARM_RANKS"  # as helpers/warm_python.py names it
PR_SET_PDEATHSIG = 1  # prctl(2)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)  # fmt: skip


def main() -> None:
    rank_pid = None
    early: list[int] = []  # signals that came before the rank had a pid

    def forward(signum: int, _frame: object) -> None:
        if rank_pid is None:
            early.append(signum)
        else:
            with contextlib.suppress(ProcessLookupError):  # it has just ended
                os.kill(rank_pid, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    # The rank is not the agent's child: should the agent die without a word, SIGTERM it.
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    zygote = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    zygote.connect(os.environ.pop(RANKS_ENV))
    request = {"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(zygote, [json.dumps(request).encode()], [0, 1, 2])
    rank_pid = json.loads(zygote.recv(1 << 16))["pid"]
    for signum in early:
        os.kill(rank_pid, signum)
    status = json.loads(zygote.recv(1 << 16))["status"]
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    sys.exit(os.waitstatus_to_exitcode(status))


main()
