"""What this device supports and which precision to use: the one place that decides.

``precision=auto`` (capability/auto.py), the warnings a run logs and records in ``summary.json``,
and ``python -m amp_exp.doctor`` all ask a ``Capability``. What the device runs at all comes from
its facts (CPU flags, CUDA compute capability) and each precision's own check: bf16 on a GPU
without native bf16 is refused before anything is measured. What is slow comes from the probe's
kernels (capability/probe.py): a precision far slower than fp32 is left out of precision=auto and
a run in it is warned. What is faster comes from the speed trial alone: a precision is
recommended only where a trial's interval establishes it faster (report/decision.py's
``established``), and the words quote the trial's figure and interval, or say that none was run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from amp_exp.capability.probe import KERNELS, Timing, cache_key, probe
from amp_exp.config.precisions import (
    AUTO,
    REFERENCE,
    PluginHook,
    ResolvedPrecision,
    get,
    names,
    probed_low,
)
from amp_exp.config.schema import PrecisionConfig
from amp_exp.errors import ConfigError
from amp_exp.report.decision import established, trial_interval
from amp_exp.report.words import show_speedup, speedup_cell
from amp_exp.runtime.hardware import cpu_flags, device_name

# A run is warned when the probe's kernels ran its precision this much slower than fp32: less is
# within the probe's noise.
WARN_SLOWER = 1.05
# Measured this many times slower than fp32, a precision is left out of precision=auto's trial.
RULED_OUT = 2.0
CPU_FLAGS_OF_INTEREST = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "amx_fp16")


def times(factor: float) -> str:
    """A speed ratio as a person says it: 25x, 1.22x, 0.07x."""
    if round(factor, 2) >= 10:
        return f"{factor:.0f}x"
    return f"{factor:.2f}x" if factor >= 1 else f"{factor:.2g}x"


def lacks_native_bf16(device: torch.device) -> bool:
    return device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False)


def check_request(requested: str, device: torch.device, cfg: PrecisionConfig) -> None:
    """Refuse a precision the device cannot run at all (as opposed to slowly); auto's
    candidates are those the device runs."""
    if requested == AUTO:
        return
    plugin = get(requested)
    spec = plugin.spec
    if spec.needs_native_bf16 and lacks_native_bf16(device):
        raise ConfigError(
            f"precision={spec.name} needs a GPU with native bf16 (compute capability "
            f"8.0+), but {torch.cuda.get_device_name(device)} lacks it; use precision=fp16 or "
            "precision=fp32"
        )
    with PluginHook(plugin, "check_device"):
        plugin.check_device(device, cfg)


def unprobed_verdicts(device: torch.device) -> dict[str, str]:
    """The precisions the probe does not time (fp8, the block-scaled formats): whether
    ``device`` runs them for real or, from their own check, what it lacks."""
    found = {}
    for spec in (get(name).spec for name in names()):
        if spec.probed_as is not None:
            continue
        try:
            check_request(spec.name, device, PrecisionConfig(name=spec.name))
        except ConfigError as error:
            found[spec.name] = str(error)
        else:
            found[spec.name] = "runs here for real (not probed: python -m amp_exp.speed times it)"
    return found


def kernels_of(model: nn.Module) -> tuple[str, ...]:
    """The probe's kernels that stand for ``model``'s work: the convolution where convolutions
    hold most of its weight matrices (a ResNet), else the matmul, with the attention block where
    it has attention (a GPT). Judged by the probe's convolution, every GPT job was warned that
    fp16 ran 6.62x slower than fp32; the GPT's own trial measured 1.6x."""
    conv = matrix = 0
    attention = False
    for module in model.modules():
        attention |= "attention" in type(module).__name__.lower()
        # Weight matrices and filters; a Hugging Face Conv1D is a linear layer.
        own = sum(p.numel() for p in module.parameters(recurse=False) if p.dim() >= 2)
        if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            conv += own
        else:
            matrix += own
    if conv > matrix:
        return ("conv",)
    return ("matmul", "attention") if attention else ("matmul",)


# A low precision's speedup over fp32 as speed.json records one (capability/ratio.py's
# ``Speedup.as_dict``: ratio, ci, confidence, rounds, trend, ...), or {"not_measured": why}.
Found = Mapping[str, Any]


# What a speed trial timed: the doctor's trial the probe's kernels, precision=auto's the model.
PROBE_KERNELS = "the probe's kernels"
THE_MODEL = "this model's forward+backward"


def trial_verdict(found: Found, timed: str = PROBE_KERNELS) -> str:
    """faster than fp32 by the speed trial on the probe's kernels: 1.47x [1.30x, 1.66x] (97.5%
    CI, 10 AB/BA rounds), total time 1.45x"""
    if "not_measured" in found:
        return f"speed not measured: {found['not_measured']}"
    claim = established(found) or "not established faster or slower"
    return f"{claim} than fp32 by the speed trial on {timed}: {show_speedup(found)}"


def recommend(trials: Mapping[str, Found]) -> tuple[str, str]:
    """The precision whose speed trial establishes the largest speedup over fp32, and why; on
    overlapping intervals one that needs no loss scaling (bf16) before one that does (fp16).
    fp32 where no trial establishes one faster, or where none was run (the words say which)."""
    faster = {p: f for p, f in trials.items() if "ratio" in f and established(f) == "faster"}
    measured = ", ".join(f"{p} {speedup_cell(f)}" for p, f in trials.items() if "ratio" in f)
    if not trials:
        return REFERENCE, (
            "no lower precision's speed was measured by a speed trial here (python -m "
            "amp_exp.doctor measures it)"
        )
    if not faster:
        return REFERENCE, (
            f"no lower precision's interval lies above fp32's speed ({measured or 'none measured'})"
        )
    best = max(faster, key=lambda p: faster[p]["ratio"])
    low = trial_interval(faster[best])[0]
    plain = [
        p
        for p in faster
        if not get(p).spec.grad_scaler and p != best and trial_interval(faster[p])[1] >= low
    ]
    chosen = plain[0] if get(best).spec.grad_scaler and plain else best
    why = f"{chosen} runs {speedup_cell(faster[chosen])} fp32's speed, its interval above 1"
    if chosen != best:
        why += f"; {best}'s interval overlaps it, and {chosen} needs no loss scaling"
    return chosen, why


@dataclass
class Capability:
    """One device's facts and measured speeds, and the verdicts drawn from them."""

    device: str  # "cpu" or "cuda"
    name: str
    facts: dict[str, Any]
    # Each supported precision's measured kernel times; fp32 is always among them.
    measured: dict[str, Timing]
    # What the measurements hold for: the device model, torch version and TF32 switch.
    key: str

    def supports(self, precision: str) -> bool:
        return precision in self.measured

    def relative_speed(self, precision: str, kernels: Sequence[str] = KERNELS) -> float:
        """Speed relative to fp32: the geometric mean over ``kernels`` (all the probe's)."""
        ratios = [self.measured[REFERENCE][k].ms / self.measured[precision][k].ms for k in kernels]
        return math.exp(sum(map(math.log, ratios)) / len(ratios))

    def tflops(self, precision: str) -> float:
        """The probe's matmul rate: a measured peak to read model FLOP utilization against."""
        return self.measured[precision]["matmul"].tflops

    def ruled_out(self, precision: str, kernels: Sequence[str] = KERNELS) -> bool:
        return (
            not self.supports(precision) or self.relative_speed(precision, kernels) * RULED_OUT <= 1
        )

    def verdicts(self, trials: Mapping[str, Found], timed: str = PROBE_KERNELS) -> dict[str, str]:
        """fp32 and each probed low precision: its speed trial's verdict, or why it has none.
        The probe speaks only of what it rules out, never of a precision being faster."""
        found = {REFERENCE: "the baseline"}
        for precision in probed_low():
            if not self.supports(precision):
                found[precision] = (
                    f"not supported: {self.name} has no native {precision} (compute capability "
                    "8.0+)"
                )
            elif precision in trials:
                found[precision] = trial_verdict(trials[precision], timed)
            else:
                found[precision] = "speed not measured: no speed trial here" + (
                    f"; the probe ran it about {times(1 / self.relative_speed(precision))} slower "
                    "than fp32, left out of precision=auto"
                    if self.ruled_out(precision)
                    else " (python -m amp_exp.doctor measures it)"
                )
        return found

    def recommendation(self, trials: Mapping[str, Found]) -> tuple[str, str]:
        """The precision to train in here, and why: the speed trial's decision (``recommend``)
        over the supported low precisions ``trials`` measured, each named where it was not."""
        supported = [p for p in probed_low() if self.supports(p)]
        chosen, why = recommend({p: trials[p] for p in supported if p in trials})
        unmeasured = [p for p in supported if p not in trials]
        if unmeasured and len(unmeasured) < len(supported):
            why += f"; {' and '.join(unmeasured)} not measured by a speed trial"
        return chosen, why

    def trial_candidates(self, kernels: Sequence[str] = KERNELS) -> list[str]:
        """What precision=auto times the run's model in: fp32 and each low precision that the
        probe's ``kernels`` (those of the model's kind) do not rule out."""
        return [REFERENCE, *(p for p in probed_low() if not self.ruled_out(p, kernels))]

    def left_out(self, kernels: Sequence[str] = KERNELS) -> str:
        """Why precision=auto does not time the low precisions it leaves out, in words."""
        unsupported = [f"{p} is not supported here" for p in probed_low() if not self.supports(p)]
        slow = [
            f"{p} about {times(1 / self.relative_speed(p, kernels))}"
            for p in probed_low()
            if self.supports(p) and self.ruled_out(p, kernels)
        ]
        if slow:
            unsupported.append(f"the probe measured {' and '.join(slow)} slower than fp32")
        return "; ".join(unsupported)

    def advice(
        self, precision: str, kernels: Sequence[str], trials: Mapping[str, Found]
    ) -> list[str]:
        """Warnings for a run in ``precision``: the probe's ``kernels`` (those of the run's
        model's kind, ``kernels_of``) ran slower than fp32 here, and what to use instead (the
        ``trials``' recommendation). Labelled as the probe's: a speed trial of the model itself
        speaks for its speed, and the report then drops this."""
        probed = get(precision).spec.probed_as
        if probed in (None, REFERENCE) or not self.supports(probed):
            return []
        speed = self.relative_speed(probed, kernels)
        if speed * WARN_SLOWER > 1:
            return []
        return [
            f"the probe's {' and '.join(kernels)} kernels ran {precision} about "
            f"{times(1 / speed)} slower than fp32 here: use "
            f"precision={self.recommendation(trials)[0]}"
        ]

    def as_dict(self, trials: Mapping[str, Found], timed: str = PROBE_KERNELS) -> dict[str, Any]:
        """What ``python -m amp_exp.doctor --json`` prints, ``trials`` its speed trials on
        ``timed``."""
        recommended, reason = self.recommendation(trials)
        return {
            "device": self.device,
            "name": self.name,
            "facts": self.facts,
            "measured": {
                p: {"tflops": self.tflops(p), "kernels": {k: vars(t) for k, t in timing.items()}}
                for p, timing in self.measured.items()
            },
            "verdicts": self.verdicts(trials, timed),
            "recommended": recommended,
            "reason": reason,
        }

    def summary(self, resolved: ResolvedPrecision, kernels: Sequence[str] = KERNELS) -> dict:
        """summary.json's ``hardware``: the doctor's findings from the speed trial precision=auto
        ran on the run's model (none for a requested precision), the advice for this run by the
        probe's ``kernels`` of its model's kind (none where the run's own model was timed in its
        precision), and the measured peak in its precision."""
        probed = get(resolved.precision).spec.probed_as
        return {
            **self.as_dict(resolved.speedups, THE_MODEL),
            "advice": []
            if resolved.timed_on_model
            else self.advice(resolved.precision, kernels, resolved.speedups),
            "advice_kernels": list(kernels),
            "measured_peak_tflops": self.tflops(probed) if probed in self.measured else None,
        }


def device_facts(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        return {
            "compute_capability": ".".join(map(str, capability)),
            "tensor_cores": capability >= (7, 0),
            "native_bf16": capability >= (8, 0),
        }
    flags = cpu_flags()
    return {
        "cpu_flags": [f for f in CPU_FLAGS_OF_INTEREST if f in flags],
        "threads": torch.get_num_threads(),
    }


def capability_of(device: torch.device, refresh: bool = False) -> Capability:
    """The device's capability; measured once per device and torch version, then cached."""
    no_bf16 = lacks_native_bf16(device)
    supported = [p for p in probed_low() if not (no_bf16 and get(p).spec.needs_native_bf16)]
    measured = probe(device, [REFERENCE, *supported], refresh=refresh)
    key = cache_key(device, REFERENCE)
    return Capability(device.type, device_name(device), device_facts(device), measured, key)
