"""What this device supports and which precision to use: the one place that decides.

``precision=auto`` (training.auto_precision), the warnings a run logs and records in
``summary.json``, and ``python -m amp_exp.doctor`` all ask a ``Capability``. Its verdicts rest on
the probe's measurements (runtime.probe); CPU flags and CUDA compute capability are supporting
facts. One request is refused from the facts alone, before anything is measured: bf16 on a GPU
without native bf16.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from amp_exp.config.precisions import AUTO, REFERENCE, PluginHook, get, names, probed_low
from amp_exp.config.schema import PrecisionConfig
from amp_exp.errors import ConfigError
from amp_exp.runtime.hardware import cpu_flags, device_name
from amp_exp.runtime.probe import KERNELS, Timing, cache_key, probe

# A low precision must be this much faster than the choice it would replace: timing noise and
# the cost of a loss scaler are not worth less.
MARGIN = 1.05
# Measured this many times slower than fp32, a precision is left out of precision=auto's trial.
RULED_OUT = 2.0
CPU_FLAGS_OF_INTEREST = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "amx_fp16")


@dataclass(frozen=True)
class ResolvedPrecision:
    precision: str
    reason: str
    # precision=auto timed the run's own model in this precision: that timing, not the probe's
    # generic kernels, speaks for its speed, so the probe's warning about it is not given.
    timed_on_model: bool = False


def times(factor: float) -> str:
    """A speed ratio as a person says it: 25x, 1.22x, 0.07x."""
    if round(factor, 2) >= 10:
        return f"{factor:.0f}x"
    return f"{factor:.2f}x" if factor >= 1 else f"{factor:.2g}x"


def cuda_facts(device: torch.device) -> dict[str, Any]:
    major, minor = torch.cuda.get_device_capability(device)
    return {
        "compute_capability": f"{major}.{minor}",
        "tensor_cores": (major, minor) >= (7, 0),
        "native_bf16": (major, minor) >= (8, 0),
    }


def check_request(requested: str, device: torch.device, cfg: PrecisionConfig) -> None:
    """Refuse a precision the device cannot run at all (as opposed to slowly); auto's
    candidates are those the device runs."""
    if requested == AUTO:
        return
    spec = get(requested).spec
    if (
        spec.needs_native_bf16
        and device.type == "cuda"
        and not torch.cuda.is_bf16_supported(including_emulation=False)
    ):
        raise ConfigError(
            f"precision={spec.name} needs a GPU with native bf16 (compute capability "
            f"8.0+), but {torch.cuda.get_device_name(device)} lacks it; use precision=fp16 or "
            "precision=fp32"
        )
    plugin = get(spec.name)
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


def probed_as(precision: str) -> str | None:
    """The probed precision whose kernels ``precision`` runs (the precision table's)."""
    return get(precision).spec.probed_as


def pick_fastest(seconds: Mapping[str, float]) -> tuple[str, str]:
    """The precision to train in, given each candidate's time (fp32's included), and why.

    fp32 stays unless a low precision is at least ``MARGIN`` faster; fp16 replaces bf16 only by
    the same margin, so on a near tie bf16 wins and no loss scaler is needed.
    """
    chosen = REFERENCE
    for low in probed_low():
        if low in seconds and seconds[low] * MARGIN <= seconds[chosen]:
            chosen = low
    fp32 = seconds[REFERENCE]
    speeds = ", ".join(f"{p} {times(fp32 / seconds[p])}" for p in seconds if p in probed_low())
    if chosen == REFERENCE:
        return chosen, (
            f"no low precision is {MARGIN - 1:.0%} faster than fp32 ({speeds} fp32's speed)"
        )
    why = f"{chosen} runs {times(fp32 / seconds[chosen])} fp32's speed"
    # Faster precisions later in the tie-break order that did not win by the margin.
    low = probed_low()
    close = [p for p in seconds if p in low and p != chosen and seconds[p] < seconds[chosen]]
    if close:
        why += f", and {' and '.join(close)} is not {MARGIN - 1:.0%} faster than {chosen}"
        if not get(chosen).spec.grad_scaler and any(get(p).spec.grad_scaler for p in close):
            why += f" ({chosen} needs no loss scaling)"
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

    def verdict(self, precision: str) -> str:
        if precision == REFERENCE:
            return "the baseline"
        if not self.supports(precision):
            return f"not supported: {self.name} has no native {precision} (compute capability 8.0+)"
        speed = self.relative_speed(precision)
        if speed >= MARGIN:
            return f"fast: {times(speed)} fp32's speed"
        if speed * MARGIN > 1:
            return f"no faster than fp32 (within {MARGIN - 1:.0%}): it saves memory, not time"
        left_out = "; left out of precision=auto" if self.ruled_out(precision) else ""
        return f"slow: about {times(1 / speed)} slower than fp32{left_out}"

    def recommendation(self, kernels: Sequence[str] = KERNELS) -> tuple[str, str]:
        seconds = {p: 1 / self.relative_speed(p, kernels) for p in self.measured}
        return pick_fastest(seconds)

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

    def advice(self, precision: str, kernels: Sequence[str] = KERNELS) -> list[str]:
        """Warnings for a run in ``precision``: the probe's ``kernels`` (those of the run's
        model's kind, ``kernels_of``) ran slower than fp32 here. Labelled as the probe's: a
        speed trial of the model itself speaks for its speed, and the report then drops this."""
        probed = probed_as(precision)
        if probed in (None, REFERENCE) or not self.supports(probed):
            return []
        speed = self.relative_speed(probed, kernels)
        if speed * MARGIN > 1:
            return []
        better = self.recommendation(kernels)[0]
        return [
            f"the probe's {' and '.join(kernels)} kernels ran {precision} about "
            f"{times(1 / speed)} slower than fp32 here: use precision={better}"
        ]

    def as_dict(self) -> dict[str, Any]:
        """What ``python -m amp_exp.doctor --json`` prints."""
        recommended, reason = self.recommendation()
        return {
            "device": self.device,
            "name": self.name,
            "facts": self.facts,
            "measured": {
                p: {
                    "relative_speed": self.relative_speed(p),
                    "tflops": self.tflops(p),
                    "kernels": {k: vars(t) for k, t in timing.items()},
                }
                for p, timing in self.measured.items()
            },
            "verdicts": {p: self.verdict(p) for p in (REFERENCE, *probed_low())},
            "recommended": recommended,
            "reason": reason,
        }

    def summary(
        self, precision: str, timed_on_model: bool = False, kernels: Sequence[str] = KERNELS
    ) -> dict[str, Any]:
        """summary.json's ``hardware``: the doctor's findings, the advice for this run by the
        probe's ``kernels`` of its model's kind (none where the run's own model was timed in its
        precision), and the measured peak in its precision."""
        return {
            **self.as_dict(),
            "advice": [] if timed_on_model else self.advice(precision, kernels),
            "advice_kernels": list(kernels),
            "measured_peak_tflops": (
                self.tflops(probed) if (probed := probed_as(precision)) in self.measured else None
            ),
        }


def supported_precisions(device: torch.device) -> list[str]:
    no_bf16 = device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False)
    return [
        REFERENCE,
        *(p for p in probed_low() if not (no_bf16 and get(p).spec.needs_native_bf16)),
    ]


def device_facts(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        return cuda_facts(device)
    flags = cpu_flags()
    return {
        "cpu_flags": [f for f in CPU_FLAGS_OF_INTEREST if f in flags],
        "threads": torch.get_num_threads(),
    }


def capability_of(device: torch.device, refresh: bool = False) -> Capability:
    """The device's capability; measured once per device and torch version, then cached."""
    precisions = supported_precisions(device)
    measured = probe(device, [p for p in precisions], refresh=refresh)
    return Capability(
        device.type,
        device_name(device),
        device_facts(device),
        {p: measured[p] for p in precisions},
        cache_key(device, REFERENCE),
    )
