"""``python -m amp_exp.doctor``: what each precision measures on this machine, and what to use.

Prints the probe's table (capability.probe: each kernel's time and rate, the peak a run's MFU is
read against) and the device's facts; then each low precision's speed against fp32, measured by
the speed trial's own method (amp_exp/capability/rounds.py: AB/BA rounds, each a forward+backward of
the probe's kernels, the interval of capability/ratio.py) and judged by the report's one rule
(report/decision.py's ``established``): a precision is called faster only where its interval lies
above fp32's speed. The recommendation follows from the same intervals. What the device lacks for
the precisions the probe does not time (fp8, mxfp8, mxfp4, nvfp4) comes from
``capability/device.py``. ``--json`` prints it all as JSON; ``--refresh`` measures the probe again
instead of reading the cache, and forgets precision=auto's cached choices.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import torch

from amp_exp.capability.auto import CACHE_FILE as AUTO_CACHE_FILE
from amp_exp.capability.cache import cache_dir, forget
from amp_exp.capability.device import (
    CPU_FLAGS_OF_INTEREST,
    Capability,
    capability_of,
    unprobed_verdicts,
)
from amp_exp.capability.probe import CACHE_FILE, KERNELS, kernel_pass
from amp_exp.capability.rounds import TRIAL_WARMUP_STEPS, pass_trials
from amp_exp.config.precisions import probed_low
from amp_exp.config.schema import DeviceChoice, TrainerConfig
from amp_exp.report.compare import BASELINE
from amp_exp.results.contract import OneLineParser, enter
from amp_exp.runtime.hardware import configure_backends, resolve_device
from amp_exp.training.timing import WARMUP_LEVEL

# The trial's warm-up rule, as speed.json states its own: each side warms up until the
# Mann-Kendall test finds no trend in its step times at this level, or for at most this many steps.
WARMUP = {"max_steps": TRIAL_WARMUP_STEPS, "level": WARMUP_LEVEL}


def speed_trials(device: torch.device, precisions: list[str]) -> dict[str, dict[str, Any]]:
    """Each precision's speedup over fp32 on the probe's kernels, as speed.json records one
    (capability/ratio.py's ``Speedup.as_dict``), or why it was not measured."""
    return pass_trials({p: kernel_pass(device, p) for p in [BASELINE, *precisions]}, device)


def table(capability: Capability) -> list[str]:
    """One row per precision: each kernel's time and rate (its speed is the trial's)."""
    rows = [["", *KERNELS]]
    for precision, timing in capability.measured.items():
        cells = [f"{timing[k].ms:.3g} ms, {timing[k].tflops:.3g} TFLOP/s" for k in KERNELS]
        rows.append([precision, *cells])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(map(str.rjust, row, widths)) for row in rows]


def facts(capability: Capability) -> str:
    """The flags or compute capability: why a measurement may come out as it does."""
    found = capability.facts
    if capability.device == "cuda":
        yes = {True: "yes", False: "no"}
        return (
            f"compute capability {found['compute_capability']}, Tensor Cores "
            f"{yes[found['tensor_cores']]}, native bf16 {yes[found['native_bf16']]}"
        )
    flags = ", ".join(found["cpu_flags"]) or "none"
    return (
        f"CPU instructions for bf16/fp16: {flags} (of {', '.join(CPU_FLAGS_OF_INTEREST)}); "
        f"{found['threads']} threads"
    )


def report(
    capability: Capability, device: torch.device, trials: dict[str, dict[str, Any]]
) -> list[str]:
    lines = [f"device: {capability.device} ({capability.name}), torch {torch.__version__}"]
    lines.append(f"probe: forward+backward, fastest round (cache: {cache_dir() / CACHE_FILE})")
    lines += ["  " + row for row in table(capability)]
    lines.append(f"facts: {facts(capability)}")
    for precision, verdict in {**capability.verdicts(trials), **unprobed_verdicts(device)}.items():
        lines.append(f"{precision}: {verdict}")
    recommended, reason = capability.recommendation(trials)
    lines.append(f"recommendation: precision={recommended}: {reason}")
    return lines


def main(argv: list[str] | None = None) -> int:
    return enter("amp_exp.doctor", lambda: diagnose(argv))


def diagnose(argv: list[str] | None) -> None:
    parser = OneLineParser(prog="python -m amp_exp.doctor")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    parser.add_argument("--refresh", action="store_true", help="measure again, ignore the cache")
    parser.add_argument(
        "--device",
        choices=[c.value for c in DeviceChoice],
        default="auto",
        help="the device to measure (default: auto, a GPU where there is one)",
    )
    args = parser.parse_args(argv)
    # The trials' progress lines, on stderr: stdout holds the findings (and --json's JSON).
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = resolve_device(DeviceChoice(args.device))
    # Measure what a default run trains with (TF32 on CUDA).
    configure_backends(device, deterministic=False, tf32=TrainerConfig.tf32)
    if args.refresh:
        forget(AUTO_CACHE_FILE)
    capability = capability_of(device, refresh=args.refresh)
    low = [p for p in probed_low() if capability.supports(p)]
    trials = speed_trials(device, low)
    if args.json:
        # The probe's kernel times and rates, the trials, the verdicts and the recommendation.
        found = {**capability.as_dict(trials), "trial": trials, "warmup": WARMUP}
        print(json.dumps({**found, "not_probed": unprobed_verdicts(device)}, indent=2))
    else:
        print("\n".join(report(capability, device, trials)))


if __name__ == "__main__":
    sys.exit(main())
