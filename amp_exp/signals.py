"""Preemption: turn SIGTERM, SIGINT and SIGUSR1 into a request to stop after the current step."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

log = logging.getLogger("amp_exp")

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StopRequest:
    """Installed for the length of a run; ``requested`` holds the first signal received.

    The first signal lets the run finish its step, checkpoint and close its loggers. A second
    SIGINT (Ctrl-C pressed again) means "now": it raises KeyboardInterrupt at once.
    """

    def __init__(self) -> None:
        self.requested: signal.Signals | None = None
        self._previous: dict[int, object] = {}

    def __call__(self) -> bool:
        return self.requested is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.requested is None:
            self.requested = signal.Signals(signum)
            log.warning(
                "%s received: finishing this step, saving a checkpoint, then exiting "
                "(press Ctrl-C again to exit at once)",
                self.requested.name,
            )

    def __enter__(self) -> StopRequest:
        # Signal handlers can only be set from the main thread (not e.g. in a joblib worker).
        if threading.current_thread() is threading.main_thread():
            for sig in PREEMPTION_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
