"""``python -m amp_exp.sensitivity``'s work: measure, rank, write, and (if asked) repair.

The model and data are built as a run builds them (tasks.workload), from the same seed, so the
batches measured are the first batches a run with these overrides trains on. Each requested
precision gets a copy of the fp32 model its own plugin converted (``convert_module``), which is
how ``precision.keep_fp32`` and fp8's conversion reach the measurement.
"""

from __future__ import annotations

import copy
import itertools
import logging
import math
from pathlib import Path
from typing import Any

from amp_exp.capability.device import check_request
from amp_exp.config.plain import plain_run_config
from amp_exp.config.precisions import target_precisions
from amp_exp.config.schema import RunConfig
from amp_exp.errors import ConfigError
from amp_exp.results.files import SENSITIVITY_JSON, read_json, write_json
from amp_exp.runtime.hardware import configure_backends, resolve_device
from amp_exp.sensitivity.measure import measure_precision, ranking
from amp_exp.sensitivity.reference import capture_reference
from amp_exp.sensitivity.repair import check_unchanged, repair
from amp_exp.sensitivity.results import (
    REPAIR_JSON,
    describe_ranking,
    sensitivity_report,
    write_sensitivity,
)
from amp_exp.sensitivity.verify import verification_plan
from amp_exp.tasks.sampling import Placement
from amp_exp.tasks.workload import build_workload
from amp_exp.training.keep_fp32 import match_keep_fp32
from amp_exp.training.precisions.base import create
from amp_exp.training.rng import seed_everything

log = logging.getLogger("amp_exp")


def finished_before(cfg: RunConfig, output_dir: Path) -> dict[str, Any] | None:
    """With ``resume=auto``, the results ``output_dir`` holds when nothing is left to do there;
    None when there is (a fresh start, or a repair to run or to continue)."""
    if cfg.resume not in (None, "auto"):
        raise ConfigError(
            f"resume={cfg.resume}: the sensitivity command continues only its own directory; "
            "run it there with resume=auto"
        )
    saved = output_dir / SENSITIVITY_JSON
    if cfg.resume is None or not saved.is_file():
        return None
    report = read_json(saved)
    recorded, asked = {"config": report.get("config")}, {"config": plain_run_config(cfg)}
    check_unchanged(recorded, asked, output_dir, "the sensitivity")
    repaired = output_dir / REPAIR_JSON
    searched = report["config"]["sensitivity"]["max_trials"]
    if cfg.sensitivity.repair and (
        not repaired.is_file() or cfg.sensitivity.max_trials != searched
    ):
        return None  # a repair to run, to continue, or to take further than it went
    if repaired.is_file():
        report["repair"] = read_json(repaired)
    log.info(
        "resume=auto: %s holds this sensitivity%s, finished; nothing to do, its results stay as "
        "they are",
        output_dir,
        " and its repair" if repaired.is_file() else "",
    )
    return report


def run_sensitivity(cfg: RunConfig, output_dir: Path) -> dict[str, Any]:
    """Measure and rank, write sensitivity.json/.md and the chart into ``output_dir``; with
    ``sensitivity.repair`` also search for the modules to keep in fp32 (repair.json)."""
    settings = cfg.sensitivity
    finished = finished_before(cfg, output_dir)
    if finished is not None:
        return finished
    if settings.repair:
        verification_plan(cfg)  # an uncalibrated plan stops here, before anything is measured
    precisions = target_precisions(settings, cfg.precision.name)
    device = resolve_device(cfg.trainer.device)
    for precision in precisions:
        check_request(precision, device, cfg.precision)
    configure_backends(device, cfg.trainer.deterministic, cfg.trainer.tf32)
    seed_everything(cfg.seed)
    workload = build_workload(cfg, Placement(cfg.seed, device))
    model, task = workload.model, workload.task
    keep_fp32 = match_keep_fp32(model, cfg.precision.keep_fp32)
    batches = [task.to_device(b) for b in itertools.islice(workload.data.train, settings.batches)]
    log.info(
        "sensitivity of model=%s on %d batch(es): fp32 reference, then %s",
        cfg.model.name,
        len(batches),
        ", ".join(precisions),
    )
    reference = capture_reference(model, task, batches, cfg.seed)
    measured = {}
    for precision in precisions:
        plugin = create(precision, cfg.precision, device, keep_fp32=keep_fp32)
        target_model = plugin.convert_module(copy.deepcopy(model))
        errors, losses, fault = measure_precision(
            model, target_model, task, batches, reference, plugin, cfg.seed
        )
        measured[precision] = (errors, losses, fault)
        log.info("%s", describe_ranking(precision, errors, ranking(errors), settings.show))
    report = sensitivity_report(cfg, model, reference, measured, keep_fp32, device)
    write_sensitivity(output_dir, report, settings.show)
    log.info("sensitivity: %s", output_dir / "sensitivity.md")
    if settings.repair:
        target: str = precisions[0]
        errors = measured[target][0]
        # A module the precision leaves exact (an embedding under autocast) has nothing to gain.
        candidates = [name for name in ranking(errors) if errors[name].margin_db < math.inf]
        outcome = repair(cfg, target, candidates, reference, keep_fp32, output_dir)
        write_json(output_dir / REPAIR_JSON, outcome)
        report["repair"] = outcome
    return report
