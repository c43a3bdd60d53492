"""Preemption: turn SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 into "stop after the current step".

Exit behaviour. The run finishes its step, saves a checkpoint, writes summary.json and closes its
loggers; then ``hand_over`` gives each signal received to the handler ``StopRequest`` displaced:

- a plain run had no Python handler there (or only Ctrl-C's ``default_int_handler``), so nothing
  happens and ``python -m amp_exp`` exits with 128 + N (143 SIGTERM, 130 SIGINT, 138 SIGUSR1,
  140 SIGUSR2);
- a job under submitit (``hydra/launcher=slurm``, ``submitit_slurm``, ``submitit_local``) has
  submitit's handler on SIGUSR2, SLURM's time-out and preemption signal: it calls the launcher's
  checkpoint hook (the same job, plus ``resume=auto``), requeues the job and exits, and the
  requeued job resumes from that checkpoint in the same directory. Submitit's SIGTERM handler
  only logs, so after SIGTERM alone the job exits with 143 and is not requeued.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

log = logging.getLogger("amp_exp")

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class StopRequest:
    """Installed for the length of a run; ``requested`` holds the first signal received.

    The first signal lets the run finish its step, checkpoint and close its loggers. A second
    SIGINT (Ctrl-C pressed again) means "now": it raises KeyboardInterrupt at once.
    """

    def __init__(self) -> None:
        self.requested: signal.Signals | None = None
        # Every signal received, in order: SLURM's preemption can send SIGTERM, then SIGUSR2.
        self._received: list[signal.Signals] = []
        self._previous: dict[int, object] = {}

    def __call__(self) -> bool:
        return self.requested is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        received = signal.Signals(signum)
        if received not in self._received:
            self._received.append(received)
        if self.requested is None:
            self.requested = received
            log.warning(
                "%s received: finishing this step, saving a checkpoint, then exiting "
                "(press Ctrl-C again to exit at once)",
                self.requested.name,
            )

    def __enter__(self) -> StopRequest:
        # Signal handlers can only be set from the main thread (not e.g. in a joblib worker).
        if threading.current_thread() is threading.main_thread():
            for sig in PREEMPTION_SIGNALS:
                # nohup and a shell's background jobs start with SIGINT ignored: the user asked
                # that it not stop the run, so it stays ignored.
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handle)
                    # A signal is caught on whichever thread the kernel picks, a gloo or NCCL
                    # thread in a socket call included: restarted, that call goes on, where an
                    # EINTR would fail the collective and the run with it.
                    signal.siginterrupt(sig, False)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def hand_over(self) -> None:
        """Call, once the run's results are on disk, the displaced handler of each signal received.

        Only Python handlers are called: SIG_DFL would kill the process before ``__main__`` sets
        the exit status, and ``default_int_handler`` would turn a clean stop into a traceback.
        A handler may not return: submitit's requeues the job and exits, or raises when the job
        has timed out ``max_num_timeout`` times already (the run then ends as failed).
        """
        for received in self._received:
            handler = self._previous.get(received)
            if callable(handler) and handler is not signal.default_int_handler:
                log.info("handing %s over to the handler it displaced: %r", received.name, handler)
                handler(received, None)
