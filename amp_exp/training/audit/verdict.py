"""Engaged or not: the audited step held against what the precision table says a run of that
precision must show (``config.precisions.Engagement``).

A precision engages when a large enough share of the matmul FLOPs ran in its dtypes, when every
linear layer fp8 converted ran float8 matmuls, and when most weight elements are stored in the
dtype a pure-bf16 run keeps them in. When it falls short, the verdict names the modules that
made it fall short: those whose matmuls ran in other dtypes, the converted linears without a
float8 matmul, the modules holding weights in another dtype.

The modules ``precision.keep_fp32`` keeps are left out of every judgement: their fp32 is asked
for, and the audit reports their share of the FLOPs beside the verdict (``kept_fp32_share``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from amp_exp.config.precisions import DType, PrecisionSpec
from amp_exp.training.audit.matmuls import MatmulFlops
from amp_exp.training.audit.modules import OUTSIDE
from amp_exp.training.keep_fp32 import is_within

# The modules a warning names, the largest first.
NAMED = 5


@dataclass
class Verdict:
    # None when nothing could be judged: no matmul ran.
    engaged: bool | None
    shortfalls: list[str] = field(default_factory=list)
    # The modules responsible for a shortfall -> what each did (a dtype's share of all matmul
    # FLOPs, or of the module's weight elements).
    responsible: dict[str, dict[str, float]] = field(default_factory=dict)

    def blame(self, module: str, shares: dict[str, float]) -> None:
        if shares:
            self.responsible.setdefault(module, {}).update(shares)


def shown_module(name: str) -> str:
    return {"": "(the model)", OUTSIDE: "(outside the model)"}.get(name, name)


def _names(dtypes: tuple[DType, ...]) -> str:
    return " or ".join(d.value for d in dtypes)


def higher_precision_modules(
    spec: PrecisionSpec, flops: MatmulFlops
) -> dict[str, dict[str, float]]:
    """Module -> dtype -> share of all matmul FLOPs, for the matmuls that ran in a wider dtype
    than the precision computes in (fp32 in a bf16 run)."""
    total = flops.total
    width = spec.compute_dtype.itemsize
    found: dict[str, dict[str, float]] = {}
    for module, dtypes in flops.by_module().items():
        wider = {d: f / total for d, f in dtypes.items() if DType(d).itemsize > width}
        if wider:
            found[module] = wider
    return found


def without_modules(flops: MatmulFlops, kept: list[str]) -> MatmulFlops:
    """``flops`` less the matmuls run inside the modules ``kept`` (outermost names)."""
    return flops.where(lambda module, _: not is_within(module, kept))


def kept_fp32_share(flops: MatmulFlops, kept: list[str]) -> float | None:
    """The share of the matmul FLOPs run inside the modules ``precision.keep_fp32`` kept."""
    if not flops.total:
        return None
    return 1 - without_modules(flops, kept).total / flops.total


def _matmul_share(spec: PrecisionSpec, flops: MatmulFlops, verdict: Verdict) -> None:
    engagement, total = spec.engaged, flops.total
    wanted = {d.value for d in engagement.matmul_dtypes}
    share = sum(f for d, f in flops.by_dtype().items() if d in wanted) / total
    if share >= engagement.min_matmul_share:
        return
    verdict.shortfalls.append(
        f"{share:.0%} of matmul FLOPs ran in {_names(engagement.matmul_dtypes)}, at least "
        f"{engagement.min_matmul_share:.0%} expected"
    )
    for module, dtypes in flops.by_module().items():
        verdict.blame(module, {d: f / total for d, f in dtypes.items() if d not in wanted and f})


def _ran_in_converted(
    flops: MatmulFlops, converted: list[str], dtypes: tuple[DType, ...], verdict: Verdict
) -> None:
    by_module = flops.by_module()
    wanted = [d.value for d in dtypes]
    idle = [name for name in converted if not any(by_module.get(name, {}).get(d) for d in wanted)]
    if not idle:
        return
    verdict.shortfalls.append(
        f"{len(idle)} of the {len(converted)} converted linears ran no {_names(dtypes)} matmul"
    )
    for name in idle:
        # Named even where it ran no matmul at all.
        shares = {d: f / flops.total for d, f in by_module.get(name, {}).items()}
        verdict.responsible.setdefault(name, {}).update(shares)


def _weights_stored(wanted: DType, elements: dict[str, dict[str, int]], verdict: Verdict) -> None:
    """Most weight elements in ``wanted``: norm layers keep fp32 by design, a tiny share."""
    total = sum(n for dtypes in elements.values() for n in dtypes.values())
    held = sum(dtypes.get(wanted.value, 0) for dtypes in elements.values())
    if not total or held / total > 0.5:
        return
    verdict.shortfalls.append(f"{held / total:.0%} of weight elements stored in {wanted.value}")
    for module, dtypes in elements.items():
        count = sum(dtypes.values())
        verdict.blame(module, {d: n / count for d, n in dtypes.items() if d != wanted.value})


def judge(
    spec: PrecisionSpec,
    flops: MatmulFlops,
    weight_elements: dict[str, dict[str, int]],
    converted: list[str] | None = None,
    kept: list[str] | tuple[str, ...] = (),
) -> Verdict:
    """Whether the audited step shows what ``spec.engaged`` asks of its precision, outside the
    modules ``kept`` in fp32."""
    flops = without_modules(flops, list(kept))
    weight_elements = {m: d for m, d in weight_elements.items() if not is_within(m, kept)}
    if not flops.total:
        where = " outside precision.keep_fp32" if kept else ""
        return Verdict(None, [f"no matmul ran in the audited step{where}"])
    verdict = Verdict(engaged=True)
    engagement = spec.engaged
    _matmul_share(spec, flops, verdict)
    if engagement.converted_dtypes and converted is not None:
        _ran_in_converted(flops, converted, engagement.converted_dtypes, verdict)
    if engagement.weights is not None:
        _weights_stored(engagement.weights, weight_elements, verdict)
    verdict.engaged = not verdict.shortfalls
    return verdict


def warning_text(precision: str, verdict: Verdict) -> str:
    """The one warning a run that did not engage gives: what fell short, and where."""
    ranked = sorted(verdict.responsible.items(), key=lambda item: -sum(item[1].values()))
    named = [
        f"{shown_module(module)} ({', '.join(f'{d} {s:.0%}' for d, s in dtypes.items())})"
        for module, dtypes in ranked[:NAMED]
    ]
    more = len(ranked) - NAMED
    where = "; ".join(named) + (f" and {more} more" if more > 0 else "")
    return (
        f"precision={precision} did not engage: {'; '.join(verdict.shortfalls)}"
        + (f". Responsible: {where}" if where else "")
        + f". This run's figures are not {precision}'s"
    )


def share_by_dtype(counts: dict[str, int]) -> dict[str, float]:
    total = sum(counts.values())
    ordered = Counter(counts).most_common()
    return {dtype: count / total for dtype, count in ordered if total}
