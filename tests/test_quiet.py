"""Third-party log lines no user can act on stay out of a run's log; the others stay in."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from amp_exp.runtime.quiet import quiet_unactionable
from helpers.warm_python import python_m

IMPORT_TORCHAO = "import torchao.float8"


def stderr_of(name: str, code: str, folder: Path) -> str:
    """What ``code`` writes to stderr in a process of its own that imports torchao afresh: one
    forked from the warm interpreter (helpers/warm_python.py), which has imported torch but
    not torchao, whose import registers the pytree nodes that torch warns of."""
    (folder / f"{name}.py").write_text(code)
    paths = [str(folder), *filter(None, [os.environ.get("PYTHONPATH")])]
    result = python_m(name, env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


@pytest.mark.slow
def test_torchaos_pytree_deprecation_lines_are_dropped_and_only_they(tmp_path: Path):
    """Caught: the filter matching nothing once torchao or torch reword the line (then the
    first assertion fails and the entry needs its new wording), or matching too much."""
    pytest.importorskip("torchao")
    assert "is an Enum subclass" in stderr_of("plain", IMPORT_TORCHAO, tmp_path)  # what users saw
    quiet = "from amp_exp.runtime.quiet import quiet_unactionable; quiet_unactionable()"
    assert "is an Enum subclass" not in stderr_of("quieted", f"{quiet}; {IMPORT_TORCHAO}", tmp_path)


def test_other_lines_of_the_same_logger_stay(caplog):
    quiet_unactionable()
    quiet_unactionable()  # twice, as two commands in one process would: still one filter
    logger = logging.getLogger("torch.utils._pytree")
    with caplog.at_level(logging.WARNING, logger="torch.utils._pytree"):
        logger.warning("%s is an Enum subclass and is now natively supported by torch.compile", "E")
        logger.warning("a pytree registration the user's own code got wrong: %s", "Thing")
    assert [r.getMessage() for r in caplog.records] == [
        "a pytree registration the user's own code got wrong: Thing"
    ]
    assert len(logger.filters) == 1
