"""The simulated constants the verdict rules read: the evidence sweeper's per-look levels
(report/sequential.py) and the skewness check's thresholds (report/shape.py), with the error
rates and power their simulation found. scripts/calibrate_rules.py writes calibration.json,
shipped in the package; tests/test_calibration.py re-simulates its stated rates."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

NAME = "calibration.json"


@cache
def calibration() -> dict[str, Any]:
    return json.loads(resources.files("amp_exp.report").joinpath(NAME).read_text("utf-8"))
