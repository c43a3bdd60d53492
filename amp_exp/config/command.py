"""What a ``python -m amp_exp.<command>`` that measures one configuration does around Hydra.

``python -m amp_exp.speed`` and ``python -m amp_exp.sensitivity`` take a run's overrides and
compose them as a run would. Before Hydra starts, ``start`` refuses what such a command cannot
do (a multirun, or a torchrun launch for a single-process one) and what the pre-flight refuses,
in one line with exit status 2, so a refused command writes nothing; inside Hydra's job,
``run_job`` turns an expected error into its one log line and exit status.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence

from amp_exp.config.preflight import check_overrides
from amp_exp.errors import EXIT_CONFIG_ERROR, EXPECTED_ERRORS, ConfigError

log = logging.getLogger("amp_exp")


def start(
    command: str,
    hydra_main: Callable[[], None],
    entry_overrides: Sequence[str],
    multirun_refusal: str,
    single_process: str | None = None,
) -> None:
    """Check the command line of ``python -m <command>`` and hand it to ``hydra_main``.

    ``entry_overrides`` go ahead of the user's, who may override them; ``multirun_refusal`` is
    what ``-m`` is told, ``single_process`` (when given) what a torchrun launch is told.
    """
    argv = sys.argv[1:]
    try:
        if {"-m", "--multirun"} & set(argv):
            raise ConfigError(multirun_refusal)
        if single_process is not None and os.environ.get("WORLD_SIZE", "1") != "1":
            raise ConfigError(single_process)
        check_overrides([*entry_overrides, *argv])
    except ConfigError as error:
        print(f"{command}: error: {error}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    sys.argv[1:] = [*entry_overrides, *argv]
    hydra_main()


def run_job(job: Callable[[], None]) -> None:
    """``job()``; an expected error ends the process with its one line and exit status."""
    try:
        job()
    except EXPECTED_ERRORS as error:
        log.error("%s", error)
        sys.exit(error.exit_status)
