"""``python -m amp_exp.doctor``: what each precision measures on this machine, and what to use.

Prints the probe's table (runtime.probe), the device's facts, a verdict per precision, what the
device lacks for the precisions the probe does not time (fp8, mxfp8, mxfp4, nvfp4) and the
recommendation, all from ``training.capability``: the same answers a run's precision=auto and its
warnings get. ``--json`` prints them as JSON; ``--refresh`` measures again instead of reading the
cache, and forgets precision=auto's cached choices.
"""

from __future__ import annotations

import json
import sys

import torch

from amp_exp.config.precisions import REFERENCE, probed_low
from amp_exp.config.schema import DeviceChoice, TrainerConfig
from amp_exp.results.contract import OneLineParser, enter
from amp_exp.runtime.cache import cache_dir, forget
from amp_exp.runtime.hardware import configure_backends, resolve_device
from amp_exp.runtime.probe import CACHE_FILE, KERNELS
from amp_exp.training.auto_precision import CACHE_FILE as AUTO_CACHE_FILE
from amp_exp.training.capability import (
    CPU_FLAGS_OF_INTEREST,
    Capability,
    capability_of,
    unprobed_verdicts,
)


def table(capability: Capability) -> list[str]:
    """One row per precision: each kernel's time and rate, and the speed relative to fp32."""
    rows = [["", *KERNELS, "vs fp32"]]
    for precision, timing in capability.measured.items():
        cells = [f"{timing[k].ms:.3g} ms, {timing[k].tflops:.3g} TFLOP/s" for k in KERNELS]
        speed = capability.relative_speed(precision)
        rows.append([precision, *cells, f"{speed:.3g}x"])
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


def report(capability: Capability, device: torch.device) -> list[str]:
    lines = [f"device: {capability.device} ({capability.name}), torch {torch.__version__}"]
    lines.append(f"measured: forward+backward, fastest round (cache: {cache_dir() / CACHE_FILE})")
    lines += ["  " + row for row in table(capability)]
    lines.append(f"facts: {facts(capability)}")
    for precision in (REFERENCE, *probed_low()):
        lines.append(f"{precision}: {capability.verdict(precision)}")
    for precision, verdict in unprobed_verdicts(device).items():
        lines.append(f"{precision}: {verdict}")
    recommended, reason = capability.recommendation()
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
    device = resolve_device(DeviceChoice(args.device))
    # Measure what a default run trains with (TF32 on CUDA).
    configure_backends(device, deterministic=False, tf32=TrainerConfig.tf32)
    if args.refresh:
        forget(AUTO_CACHE_FILE)
    capability = capability_of(device, refresh=args.refresh)
    if args.json:
        found = {**capability.as_dict(), "not_probed": unprobed_verdicts(device)}
        print(json.dumps(found, indent=2))
    else:
        print("\n".join(report(capability, device)))


if __name__ == "__main__":
    sys.exit(main())
