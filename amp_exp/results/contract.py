"""The contract every ``python -m amp_exp.*`` command keeps, written once; each command's
``main`` enters through ``enter``. Which directory a command may write is results/ownership.py's;
this module is how a command starts and how it ends.

- **Its directory is claimed** before anything is written there (``start`` claims a measuring
  command's with ``ownership.claim_directory``; training claims its own, the report holds only
  the directory it writes into): finished results are never replaced unless ``--force`` says so,
  and a refused command writes nothing.
- **Bad input is one line and exit 2** (``ConfigError``, and ``OneLineParser`` for flags), a
  numerical fault exit 3, a runtime fault exit 4 (a full disk, a dead rank), each one line on
  stderr with no traceback.
- **User code cannot end the command**: a model, data set or loss that calls ``sys.exit()`` is a
  runtime fault (``user_code_cannot_exit``), never a silent exit 0.
- **Signals stop it with 128 + N** (143 SIGTERM, 130 SIGINT, 138 SIGUSR1, 140 SIGUSR2). Training
  finishes its step and checkpoints first (runtime/signals.py, whose handler displaces this one
  for a run and hands the signal back after it); a measuring command stops where it is, having
  written only whole files.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import NoReturn

from amp_exp.config.help import flags_help
from amp_exp.config.preflight import check_overrides
from amp_exp.errors import EXPECTED_ERRORS, ConfigError, RuntimeFault
from amp_exp.results.ownership import FORCE_FLAG, claim_directory
from amp_exp.runtime.quiet import quiet_unactionable
from amp_exp.runtime.signals import PREEMPTION_SIGNALS

log = logging.getLogger("amp_exp")


class Stopped(BaseException):
    """A signal stopped the command. A BaseException, so that no ``except Exception`` in the
    command or in user code takes it for a failure and carries on."""

    def __init__(self, received: signal.Signals) -> None:
        super().__init__(received)
        self.received = received


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a bad flag as one line and exit 2 (argparse prints its usage first), and
    --help in the shape every command's has (config/help.py): what the command does and how to
    call it from help.COMMANDS, then its flags."""

    def format_help(self) -> str:
        formatter = self._get_formatter()
        for group in self._action_groups:
            formatter.add_arguments(group._group_actions)
        return flags_help(self.prog.removeprefix("python -m "), formatter.format_help()) + "\n"

    def error(self, message: str) -> NoReturn:
        # "amp_exp.report: error: ...", as every other one-line error of a command begins.
        print(f"{self.prog.removeprefix('python -m ')}: error: {message}", file=sys.stderr)
        sys.exit(2)


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise Stopped(signal.Signals(signum))


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Each preemption signal raises ``Stopped`` for the length of the block."""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers can be set only from the main thread
        return
    previous = {s: signal.signal(s, _raise_stopped) for s in PREEMPTION_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def enter(command: str, body: Callable[[], int | None], signals: bool = True) -> int:
    """Run ``body`` (a command's work; returns its exit status, None for 0) under the contract;
    returns the status the command exits with. ``signals=False`` leaves the signals to the
    command (training finishes its step first; a Ctrl-C before that still stops in one line)."""
    quiet_unactionable()
    try:
        with stop_on_signals() if signals else contextlib.nullcontext():
            return body() or 0
    except Stopped as stopped:
        received = stopped.received
    except KeyboardInterrupt:  # Python's own SIGINT handler, where no other was installed
        received = signal.SIGINT
    except EXPECTED_ERRORS as error:
        print(f"{command}: error: {error}", file=sys.stderr)
        return error.exit_status
    print(f"{command}: stopped by {received.name}", file=sys.stderr)
    return 128 + received


@contextlib.contextmanager
def user_code_cannot_exit() -> Iterator[None]:
    """A model, data set or loss that calls ``sys.exit()`` ends the command as failed (exit 4):
    a command's exit status and its results are amp_exp's to write."""
    try:
        yield
    except SystemExit as escaped:
        raise RuntimeFault(
            f"the run's model or data code raised SystemExit({escaped.code!r}); amp_exp stopped "
            "the run: remove the sys.exit() call from it"
        ) from None


def start(
    command: str,
    hydra_main: Callable[[], None],
    entry_overrides: Sequence[str],
    multirun_refusal: str,
    single_process: str | None = None,
    resumable: bool = False,
) -> NoReturn:
    """``python -m <command> [--force] [overrides]`` for a command that Hydra composes as a run:
    its command line checked before Hydra starts (``multirun_refusal`` is what ``-m`` is told,
    ``single_process``, when given, what a torchrun launch is told), its run directory claimed,
    then ``hydra_main``. ``entry_overrides`` go ahead of the user's, who may override them. A
    ``resumable`` command given ``resume=auto`` may go on in a directory holding its own results
    (it decides what is left to do there)."""

    def body() -> None:
        # --force is the command's own flag, never a Hydra override.
        argv = [arg for arg in sys.argv[1:] if arg != FORCE_FLAG]
        force = FORCE_FLAG in sys.argv[1:]
        if {"-m", "--multirun"} & set(argv):
            raise ConfigError(multirun_refusal)
        if single_process is not None and os.environ.get("WORLD_SIZE", "1") != "1":
            raise ConfigError(single_process)
        launch = check_overrides([*entry_overrides, *argv])
        sys.argv[1:] = [*entry_overrides, *argv]
        if launch is None or not launch.output_dir.resolved:  # --help, --cfg: nothing is written
            hydra_main()
            return
        resumes = resumable and launch.jobs[0].resume == "auto"
        with claim_directory(command, Path(launch.output_dir.value), force, resumable, resumes):
            hydra_main()

    sys.exit(enter(command, body))


def run_job(job: Callable[[], None]) -> None:
    """``job()`` inside a command's Hydra job: an expected error (and user code's ``sys.exit``)
    ends the process with its one log line and exit status."""
    try:
        with user_code_cannot_exit():
            job()
    except EXPECTED_ERRORS as error:
        log.error("%s", error)
        sys.exit(error.exit_status)
