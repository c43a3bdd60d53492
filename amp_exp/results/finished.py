"""Which command's finished results a directory holds: the one fact every command's directory
claim reads (results/claim.py for runs, results/contract.py for the others)."""

from __future__ import annotations

from pathlib import Path

from amp_exp.results.files import MULTIRUN_SPEC, PREDICT_JSON, SENSITIVITY_JSON, SPEED_JSON
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
    if (directory / MULTIRUN_SPEC).is_file():
        # A sweep's own directory: its jobs, report and speed trial belong together, and a
        # command's files written among them would be taken for the sweep's.
        found["amp_exp -m"] = f"a sweep's results ({MULTIRUN_SPEC})"
    for command, name in RESULT_FILES.items():
        if (directory / name).is_file():
            found[command] = f"the finished results of python -m {command} ({name})"
    return found
