"""What ``pip install .`` (not editable) gets: the package, its configs and the launcher plugin."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from amp_exp.config.preflight import CONF_DIR

REPO = Path(__file__).resolve().parent.parent


def test_the_wheel_carries_every_config_and_the_launcher_classes(tmp_path: Path) -> None:
    build = ["wheel", "--no-deps", "--no-build-isolation", "-q", str(REPO), "-w", str(tmp_path)]
    subprocess.run([sys.executable, "-m", "pip", *build], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("amp_exp-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {f"amp_exp/conf/{p.relative_to(REPO / 'conf')}" for p in REPO.glob("conf/**/*.yaml")}
    assert "amp_exp/conf/config.yaml" in configs
    assert configs <= names
    assert "hydra_plugins/_amp_exp_submitit.py" in names
    # The results format's schemas: an installed amp_exp validates and reads results with them.
    schemas = {f"amp_exp/results/schema/{p.name}" for p in REPO.glob("amp_exp/results/schema/*")}
    assert "amp_exp/results/schema/summary.v1.json" in schemas
    assert schemas <= names
    # In a checkout the package's conf/ is the repository's, so edits there take effect.
    assert CONF_DIR.resolve() == REPO / "conf"
