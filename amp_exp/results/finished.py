"""Which command's finished results a directory holds: the one fact every command's directory
claim reads (results/claim.py for runs, results/contract.py for the others)."""

from __future__ import annotations

from pathlib import Path

from amp_exp.results.files import PREDICT_JSON, SENSITIVITY_JSON, SPEED_JSON
from amp_exp.results.summary import completed_summary

# The file each measuring command writes last, once its result is whole: while it is absent the
# command did not finish there. A training run's mark is a completed summary.json.
RESULT_FILES = {
    "amp_exp.speed": SPEED_JSON,
    "amp_exp.sensitivity": SENSITIVITY_JSON,
    "amp_exp.predict": PREDICT_JSON,
}


def finished_results(directory: Path) -> dict[str, str]:
    """Each command whose finished result ``directory`` holds, with that result in words."""
    found = {}
    completed = completed_summary(directory)
    if completed is not None:
        found["amp_exp"] = f"a completed run ({completed.get('steps')} steps)"
    for command, name in RESULT_FILES.items():
        if (directory / name).is_file():
            found[command] = f"the finished results of python -m {command} ({name})"
    return found
