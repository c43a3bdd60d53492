"""A precision defined outside amp_exp, in a package this test writes, runs end to end: it trains,
resumes bit-exactly, shows in the audit, the report, sensitivity and precision=auto, and is refused
under a strategy its facts do not list, with no file of amp_exp touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from amp_exp.config import precisions
from amp_exp.errors import ConfigError
from amp_exp.report import plots
from amp_exp.report.assemble import build_report
from amp_exp.run import build, train
from amp_exp.sensitivity.command import run_sensitivity
from helpers.probes import inject_probe
from helpers.runs import FAST_LM
from test_auto_precision import with_trial
from test_checkpoint import MODES, assert_resume_is_exact
from test_diagnostics import trial_at

NAME = "halfway"
TARGET = "halfway_precision.Halfway"
# The package's whole source: what docs/precision.md shows as "Adding a precision".
SOURCE = '''
"""halfway: bf16 autocast that counts its optimizer steps (its own state, saved and resumed)."""

from __future__ import annotations

from dataclasses import dataclass

from amp_exp.config.precisions import DType, Engagement, PrecisionSpec
from amp_exp.config.schema import Strategy
from amp_exp.training.precisions.base import PrecisionPlugin


@dataclass
class Options:
    # Count the optimizer steps this precision took (precision.options.count_steps).
    count_steps: bool = True


class Halfway(PrecisionPlugin):
    Options = Options
    # What differs from fp32's facts (PrecisionSpec's defaults).
    spec = PrecisionSpec(
        name="halfway",
        order=10,
        colour="#123456",
        compute_dtype=DType.bfloat16,
        autocast_dtype=DType.bfloat16,
        peak_math="bf16",
        probed_as="halfway",
        strategies=frozenset({Strategy.ddp}),
        engaged=Engagement(0.5, (DType.bfloat16,)),
        auto_candidate=True,
        rankable=True,
    )

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps = 0

    def optimizer_step(self, optimizer) -> None:
        optimizer.step()
        self.steps += self.options.count_steps

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = state["steps"]

    def summary(self) -> dict:
        return {"precision_details": {"steps": self.steps}}
'''
PLUGIN = [f"precision._target_={TARGET}", f"precision.name={NAME}"]


@pytest.fixture
def plugin_package(tmp_path, monkeypatch) -> Path:
    """The package on sys.path, a registry that forgets it after the test, and a probe cache of
    the test's own that knows it (the session's stays as other tests injected it)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    inject_probe({"fp32": 1.0, "bf16": 0.9, "fp16": 0.02, NAME: 0.9})
    package = tmp_path / "package"
    package.mkdir()
    (package / "halfway_precision.py").write_text(textwrap.dedent(SOURCE))
    monkeypatch.syspath_prepend(str(package))
    precisions.names()  # the built-ins and entry points, found once
    monkeypatch.setattr(precisions, "_plugins", dict(precisions._plugins))
    return package


def test_it_trains_resumes_bit_exactly_and_engages_in_the_audit(
    plugin_package, run_cfg, override_loss, tmp_path
) -> None:
    whole = assert_resume_is_exact(run_cfg, override_loss, tmp_path, [*MODES, *PLUGIN])
    resumed = json.loads((tmp_path / "split" / "summary.json").read_text())
    assert whole["precision"] == resumed["precision"] == NAME
    # Its own state came back from the checkpoint: 12 steps counted, not 12 - 5.
    assert whole["precision_details"] == resumed["precision_details"] == {"steps": 12}
    assert whole["precision_audit"]["engaged"] is True
    assert whole["precision_audit"]["flops_by_dtype"]["bfloat16"] > 0.5


def test_the_report_orders_labels_and_colours_it_from_its_facts(
    plugin_package, run_cfg, tmp_path
) -> None:
    for precision in ("fp32", NAME):
        overrides = [*MODES, *(PLUGIN if precision == NAME else ["precision=fp32"])]
        train(run_cfg(*overrides), tmp_path / "runs" / precision)
    # As a fresh report process would: the plugin's facts come from the run's summary.json, as
    # data; the module its config names is never imported (registered) again.
    precisions._plugins.pop(NAME)
    report = build_report([tmp_path / "runs"], tmp_path / "report")
    assert NAME not in precisions._plugins
    assert [row["precision"] for row in report["runs"]] == ["fp32", NAME]
    (comparison,) = report["comparisons"]
    assert (comparison["precision"], comparison["label"]) == (NAME, NAME)
    assert plots.precision_color(NAME) == "#123456"
    assert NAME in (tmp_path / "report" / "report.md").read_text()


def test_sensitivity_ranks_its_modules(plugin_package, compose_cfg, tmp_path) -> None:
    from amp_exp.config.values import validate

    overrides = [*FAST_LM, *PLUGIN, f"sensitivity.precisions=[{NAME}]", "sensitivity.batches=1"]
    report = run_sensitivity(validate(compose_cfg(*overrides, fast=False)), tmp_path)
    assert report["precisions"] == [NAME]
    assert "lm_head" in report["rankings"][NAME]


def test_precision_auto_times_it_and_can_choose_it(plugin_package, run_cfg, monkeypatch) -> None:
    inject_probe({"fp32": 1.0, "bf16": 0.02, "fp16": 0.02, NAME: 1.5})
    trials = with_trial(monkeypatch, {NAME: trial_at(3.0, 2.5, 3.5)})
    built = build(run_cfg(*MODES, f"precision._target_={TARGET}"))
    assert trials == [["fp32", NAME]]
    assert built.resolved.precision == NAME
    assert built.resolved.reason.startswith(f"auto: {NAME}")


def test_a_strategy_its_facts_do_not_list_is_refused_in_one_line(plugin_package, run_cfg):
    with pytest.raises(ConfigError) as refused:
        run_cfg(*MODES, *PLUGIN, "trainer.strategy=fsdp2")
    assert str(refused.value) == (
        f"precision={NAME} does not run with trainer.strategy=fsdp2 yet; valid choices: ddp"
    )


def test_its_options_are_typed_and_checked_before_torch_loads(plugin_package) -> None:
    """In a fresh interpreter: the plugin loads, its bad option is refused in one line, and
    torch is never imported; from the command line the refusal is that line and exit 2."""
    check = (
        "import sys\n"
        "from amp_exp.config.cross_checks import validate_precision\n"
        "from amp_exp.config.schema import PrecisionConfig, TrainerConfig\n"
        "from amp_exp.errors import ConfigError\n"
        f"cfg = PrecisionConfig(name={NAME!r}, _target_={TARGET!r}, "
        "options={'count_steps': 'sometimes'})\n"
        "try:\n    validate_precision(cfg, TrainerConfig())\n"
        "except ConfigError as error:\n    print(error)\n"
        "print('torch' in sys.modules)\n"
    )
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_package), str(root)])}
    fresh = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, env=env, timeout=120
    )
    refusal = (
        f"precision.options.count_steps of precision={NAME}: Value 'sometimes' is not a valid "
        "bool (type str)"
    )
    assert fresh.stdout.splitlines() == [refusal, "False"], fresh.stderr
    cli = subprocess.run(
        [sys.executable, "-m", "amp_exp", *PLUGIN, "+precision.options.count_steps=sometimes"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert (cli.returncode, cli.stderr.strip()) == (2, f"amp_exp: error: {refusal}")


def test_an_installed_package_s_entry_point_registers_it_by_name(plugin_package, monkeypatch):
    info = plugin_package / "halfway_precision-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: halfway-precision\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[amp_exp.precisions]\n{NAME} = {TARGET.replace('.', ':')}\n"
    )
    monkeypatch.setattr(precisions, "_plugins", {})
    monkeypatch.setattr(precisions, "_found", set())
    assert precisions.names()[-1] == NAME
    assert precisions.get(NAME).spec.colour == "#123456"
