"""Third-party log lines a user cannot act on, kept out of a run's log by their message.

Each entry names the logger and the start of the message, and why no user can act on it: a
line the user could act on (a deprecation in their own config, a transformers warning about
their model) must stay, so nothing is silenced by logger or level alone.
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


def quiet_unactionable() -> None:
    """Install the filters (once per process: a second call adds nothing)."""
    for name, starts in UNACTIONABLE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DropMessages) for f in logger.filters):
            logger.addFilter(DropMessages(starts))
