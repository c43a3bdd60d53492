"""``python -m amp_exp.doctor``: what this machine offers for mixed precision, and what to use."""

from __future__ import annotations

import torch

from amp_exp.config.schema import DeviceChoice
from amp_exp.runtime.hardware import (
    inspect_hardware,
    precision_advice,
    recommend_precision,
    resolve_device,
)


def report(device: torch.device) -> list[str]:
    hardware = inspect_hardware(device)
    lines = [f"device: {hardware['device']} ({hardware['name']})"]
    if hardware["device"] == "cuda":
        lines.append(
            f"compute capability {hardware['compute_capability']}: Tensor Cores "
            f"{'yes' if hardware['tensor_cores'] else 'no'}, native bf16 "
            f"{'yes' if hardware['native_bf16'] else 'no'}"
        )
    else:
        flags = ", ".join(hardware["cpu_flags"]) or "none"
        lines.append(f"low-precision CPU instructions: {flags}")
    for precision in ("fp16", "bf16"):
        advice = precision_advice(precision, hardware)
        lines.append(f"{precision}: " + (advice[0] if advice else "can run fast here"))
    choice, why = recommend_precision(hardware)
    lines.append(f"recommendation: precision={choice} ({why})")
    return lines


def main() -> None:
    print("\n".join(report(resolve_device(DeviceChoice.auto))))


if __name__ == "__main__":
    main()
