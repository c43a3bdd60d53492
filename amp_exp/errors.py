"""The ways a run can fail on purpose, each with its own exit status. Imports nothing.

- ``ConfigError`` (exit 2): the command asked for something that cannot run. Raised before any
  training where possible; the message is one line that says what to change. ``RunRefused``, a
  kind of it, refuses a run directory (busy, or resumed with a changed config) and writes
  nothing there, not even a failure summary.
- ``RuntimeFault`` (exit 4): the run started, and what it found on disk or among its ranks does
  not let it go on (a checkpoint from another world size, ranks that resumed at different steps,
  a full disk). ``NoCheckpointLoads``, a kind of it, stops a resume whose checkpoints all fail
  to load, and writes nothing either.
- ``NumericalFault`` (exit 3): training cannot go on in this precision; the message says why and
  what to try.
"""

from __future__ import annotations

from collections.abc import Sequence

EXIT_CONFIG_ERROR = 2
EXIT_NUMERICAL_FAULT = 3
EXIT_RUNTIME_FAULT = 4


class ConfigError(ValueError):
    """A config value that cannot run; its message is one line that says what to change."""

    exit_status = EXIT_CONFIG_ERROR


class RunRefused(ConfigError):
    """This run may not use its directory as asked; the directory was left exactly as it was."""


class RuntimeFault(RuntimeError):
    """The run's files or its ranks disagree with what it was asked to do; one line says why."""

    exit_status = EXIT_RUNTIME_FAULT


class NoCheckpointLoads(RuntimeFault):
    """A resume found checkpoints and none of them loads; the directory was left as it was."""


class NumericalFault(RuntimeError):
    """Training cannot go on in this precision; the message says why and what to try."""

    exit_status = EXIT_NUMERICAL_FAULT


# The errors whose message is the whole story: the entry point prints it as one line.
EXPECTED_ERRORS = (ConfigError, RuntimeFault, NumericalFault)
# The errors raised before a run wrote anything, which leave its directory as it was: no failure
# summary is recorded for them.
WRITES_NOTHING = (RunRefused, NoCheckpointLoads)


def require(condition: bool, message: str) -> None:
    """Raise ``ConfigError(message)`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(message)


def require_choice(value: object, choices: Sequence[str], what: str) -> None:
    """Raise ``ConfigError`` in one line, ``what`` and then the valid choices, unless ``value``
    is one of ``choices``."""
    require(value in choices, f"{what}; valid choices: {', '.join(choices)}")


def first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text
