"""Third-party log lines a user cannot act on, kept out of a run's log by their message; and
amp_exp's own lines about the machine, said once per process rather than once per job.

Each entry names the logger and the start of the message, and why no user can act on it: a
line the user could act on (a deprecation in their own config, a transformers warning about
their model) must stay, so nothing is silenced by logger or level alone.

A line logged with ``extra=once_per(sweep)`` states a fact of the machine, the same for every
job of a sweep (the hardware probe's advice): Hydra's local launcher runs a sweep's jobs in one
process, so it prints at the sweep's first job and its other jobs keep quiet.
"""

from __future__ import annotations

import logging

UNACTIONABLE = {
    # torchao 0.18 registers its enums (KernelPreference, ScaleCalculationMode) as pytree
    # constants when it is imported; torch 2.14 deprecates that for enums. torchao's own code,
    # printed twice by every fp8 and model=hf run.
    "torch.utils._pytree": (
        "%s is an Enum subclass and is now natively supported by torch.compile",
    ),
}


class DropMessages(logging.Filter):
    """Drops the records whose unformatted message starts with one of ``starts``."""

    def __init__(self, starts: tuple[str, ...]) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def once_per(scope: str | None) -> dict[str, str]:
    """A log call's ``extra`` for a line said once per ``scope`` (a sweep's directory) in this
    process; with no scope (a single run), every time."""
    return {} if scope is None else {"once": scope}


class OncePerScope(logging.Filter):
    """Drops a record marked by ``once_per`` whose message this process has logged already in
    the same scope."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        scope = getattr(record, "once", None)
        if scope is None:
            return True
        key = (scope, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def quiet_unactionable() -> None:
    """Install the filters (once per process: a second call adds nothing)."""
    for name, starts in UNACTIONABLE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in logger.filters):
            logger.addFilter(DropMessages(starts))
    own = logging.getLogger("amp_exp")
    if not any(isinstance(f, OncePerScope) for f in own.filters):
        own.addFilter(OncePerScope())
