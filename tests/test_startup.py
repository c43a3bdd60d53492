"""Start-up: a single run is composed once, by the pre-flight, and starts as Hydra starts one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from helpers.runs import FAST, TINY_MLP
from helpers.warm_python import python_m

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parent


def compositions(*args: str, cwd: Path) -> tuple[int, str]:
    pythonpath = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    result = python_m(
        "helpers.count_compositions", *args, cwd=cwd, env={**os.environ, "PYTHONPATH": pythonpath}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    count = int(result.stdout.strip().splitlines()[-1].removeprefix("compositions: "))
    return count, result.stderr


def test_a_single_run_is_composed_once_and_records_its_config_as_hydra_does(tmp_path):
    count, _ = compositions(
        *FAST, *TINY_MLP, "trainer.max_steps=2", f"hydra.run.dir={tmp_path}", cwd=tmp_path
    )
    assert count == 1  # Hydra's own entry point would compose twice more
    assert (tmp_path / "summary.json").is_file()
    saved = yaml.safe_load((tmp_path / ".hydra" / "hydra.yaml").read_text())["hydra"]
    assert saved["mode"] == "RUN" and "hydra.mode=RUN" in saved["overrides"]["hydra"]
    assert "trainer.max_steps=2" in yaml.safe_load(
        (tmp_path / ".hydra" / "overrides.yaml").read_text()
    )


def test_a_sweep_still_goes_through_hydra_s_sweeper(tmp_path):
    # One job of a tiny MLP: the sweep's compositions are what is counted, not its jobs.
    args = ("-m", *FAST, *TINY_MLP, "trainer.max_steps=1", "seed=0", f"hydra.sweep.dir={tmp_path}")
    count, _ = compositions(*args, cwd=tmp_path)
    assert {p.name for p in tmp_path.iterdir() if p.is_dir()} >= {"0"}
    assert count > 2  # the pre-flight's, then Hydra's for the sweep and the job
