"""The probe: how fast each precision's forward and backward pass runs here, measured.

CPU flags say which instructions exist, not which kernels PyTorch dispatches to: a Xeon with
avx512_fp16 trained ResNet-18 140x slower in fp16 than in fp32. So three kernels that stand for
what models spend their time on (a matmul, a 3x3 convolution, and an attention block with a
layer norm) run forward and backward, the forward under the autocast the precision gets in
training. The precisions take turns, round after round, and each keeps its fastest round: a load
spike from another process then slows one round of every precision rather than all rounds of
one. Each kernel's time carries its spread: how far its ratio to fp32's lies from the typical
round's (``ratio_spread``). Results are cached per device, torch version and
precision (``capability.cache``); a cache whose spread is wide is measured again, once, all
precisions together.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone

import torch
import torch.nn.functional as F

from amp_exp.capability.cache import cache_dir, read_entries, write_entries
from amp_exp.config.precisions import REFERENCE, get
from amp_exp.runtime.hardware import cpu_flags, device_name
from amp_exp.training.timing import StepClock, time_steps

log = logging.getLogger("amp_exp")

CACHE_FILE = "probe.json"
KERNELS = ("matmul", "conv", "attention")

# No kernel or training step is timed faster than a microsecond, and no precision runs 1000 times
# faster or slower than fp32 on one (fp16 on CPUs without its kernels: 20-140x slower).
MIN_PLAUSIBLE_MS = 1e-3
PLAUSIBLE_RATIO = 1e3
# A cached speed whose figure lies further than this from its typical round (``ratio_spread``)
# is measured again rather than reused: a default run once chose bf16 at a cached 5.14x fp32's
# speed that a fresh measurement put at 2.07x.
WIDE_SPREAD = 0.25


def ratio_spread(baseline: Sequence[float], candidate: Sequence[float]) -> float:
    """How far the speed figure, the baseline's fastest round over the candidate's, lies from
    the median of the rounds' own ratios (each round timed both sides in turn): 0.3 when either
    is 1.3 times the other. One round that a neighbour slowed moves neither; fastest rounds that
    caught the two sides at different moments of a loaded machine move the figure alone."""
    figure = min(baseline) / min(candidate)
    typical = statistics.median(b / c for b, c in zip(baseline, candidate, strict=True))
    return max(figure / typical, typical / figure) - 1


@dataclass(frozen=True)
class Shapes:
    """Kernel sizes: large enough to reach the device's speed, small enough to time quickly."""

    matmul: int  # n of an (n x n) @ (n x n) product
    conv: tuple[int, int, int]  # batch, channels in = out, height = width
    attention: tuple[int, int, int, int]  # batch, tokens, width, heads


SHAPES = {
    # fp16 on a CPU without fp16 kernels runs 20-140x slower: a few hundred ms per round there.
    "cpu": Shapes(256, (8, 32, 16), (4, 64, 128, 4)),
    # The matmul is the measured peak a run's MFU can be read against.
    "cuda": Shapes(8192, (64, 128, 56), (8, 1024, 1024, 16)),
}


@dataclass(frozen=True)
class KernelTime:
    ms: float
    tflops: float
    # How far the ratio to fp32's time lies from the typical round's (0 for fp32 itself).
    spread: float = 0.0


# One precision's measurement: each kernel's fastest forward+backward.
Timing = dict[str, KernelTime]
FIELDS = ("ms", "tflops", "spread")


def device_key(device: torch.device) -> str:
    """What the measurements belong to: the device model and the torch build."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        # Virtual machines often report a generic model name ("AMD EPYC") for different
        # generations; their flags tell them apart.
        flags = " ".join(sorted(cpu_flags()))
        name = f"{device_name(device)} [flags {hashlib.sha1(flags.encode()).hexdigest()[:8]}]"
    return f"{name} | torch {torch.__version__}"


def cache_key(device: torch.device, precision: str) -> str:
    """The device, torch and the precision as measured: fp32 matmuls on CUDA run on TF32 Tensor
    Cores when allowed."""
    if precision == REFERENCE and device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        precision = "fp32+tf32"
    return f"{device_key(device)} | {precision}"


def _kernels(
    shapes: Shapes, device: torch.device
) -> dict[str, tuple[Callable[[], torch.Tensor], tuple[torch.Tensor, ...], float]]:
    """name: (forward, the leaves its backward differentiates, forward+backward FLOPs)."""
    # A generator of its own: the probe draws nothing from the run's random streams.
    generator = torch.Generator(device).manual_seed(0)

    def leaf(*size: int, scale: float = 1.0, memory_format=torch.contiguous_format):
        values = torch.randn(*size, generator=generator, device=device) * scale
        return values.contiguous(memory_format=memory_format).requires_grad_()

    n = shapes.matmul
    a, b = leaf(n, n), leaf(n, n)
    batch, channels, size = shapes.conv
    memory_format = torch.channels_last if device.type == "cuda" else torch.contiguous_format
    images = leaf(batch, channels, size, size, memory_format=memory_format)
    filters = leaf(channels, channels, 3, 3, scale=(9 * channels) ** -0.5)
    seqs, tokens, width, heads = shapes.attention
    x = leaf(seqs, tokens, width)
    norm_weight, norm_bias = leaf(width), leaf(width)
    qkv_weight = leaf(3 * width, width, scale=width**-0.5)
    out_weight = leaf(width, width, scale=width**-0.5)

    def attention() -> torch.Tensor:
        h = F.layer_norm(x, (width,), norm_weight, norm_bias)
        q, k, v = F.linear(h, qkv_weight).view(seqs, tokens, 3, heads, -1).unbind(2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return x + F.linear(o.transpose(1, 2).reshape(seqs, tokens, width), out_weight)

    # Backward costs about twice the forward (a gradient for the input and one for the weight).
    attention_flops = 2 * seqs * tokens * width * 4 * width + 4 * seqs * tokens * tokens * width
    return {
        "matmul": (lambda: a @ b, (a, b), 3 * 2 * n**3),
        "conv": (
            lambda: F.conv2d(images, filters, padding=1),
            (images, filters),
            3 * 2 * batch * channels * channels * 9 * size * size,
        ),
        "attention": (
            attention,
            (x, norm_weight, norm_bias, qkv_weight, out_weight),
            3 * attention_flops,
        ),
    }


def _run(
    device: torch.device,
    precision: str,
    forward: Callable[[], torch.Tensor],
    leaves: tuple[torch.Tensor, ...],
) -> None:
    """One forward, under the autocast the precision's facts give it (none for fp32), as in
    training, and its backward."""
    dtype = get(precision).spec.autocast_dtype
    with torch.autocast(device.type, dtype=dtype and dtype.torch, enabled=dtype is not None):
        out = forward()
    torch.autograd.grad(out, leaves, torch.ones_like(out))


def _forward_backward(
    device: torch.device,
    precision: str,
    forward: Callable[[], torch.Tensor],
    leaves: tuple[torch.Tensor, ...],
) -> float:
    """Seconds for one ``_run``, clocked as the speed trial clocks a step."""
    return time_steps(lambda: _run(device, precision, forward, leaves), StepClock(device), 1)[0]


def kernel_pass(
    device: torch.device, precision: str, shapes: Shapes | None = None
) -> Callable[[], None]:
    """One forward (under the precision's autocast) and backward of each of the probe's
    kernels: the step the doctor's speed trial times (amp_exp/doctor.py)."""
    kernels = _kernels(shapes or SHAPES[device.type], device)

    def step() -> None:
        for forward, leaves, _ in kernels.values():
            _run(device, precision, forward, leaves)

    return step


def measure(
    device: torch.device,
    precisions: Iterable[str],
    shapes: Shapes | None = None,
    budget_s: float = 0.2,
    min_rounds: int = 3,
    max_rounds: int = 20,
) -> dict[str, Timing]:
    """Each precision's fastest forward+backward of each kernel, in turns.

    Every kernel gets about ``budget_s`` per precision, and at least ``min_rounds`` rounds. The
    first round (kernel selection, cuDNN autotuning, oneDNN primitive creation) is not kept. In
    a round each precision repeats its kernel for a turn of ``budget_s / 4``: a fast kernel then
    gets many tries at a moment when no other process holds a core, a slow one still gets one.
    """
    precisions = list(precisions)
    kernels = _kernels(shapes or SHAPES[device.type], device)
    # Each precision's fastest pass of each kernel in each round after the first.
    fastest: dict[str, dict[str, list[float]]] = {p: {k: [] for k in kernels} for p in precisions}
    for name, (forward, leaves, _) in kernels.items():
        ends = time.perf_counter() + budget_s * len(precisions)
        for rounds in range(max(min_rounds, max_rounds)):
            if rounds >= min_rounds and time.perf_counter() >= ends:
                break
            for precision in precisions:
                turn_ends = time.perf_counter() + budget_s / 4
                turn = _forward_backward(device, precision, forward, leaves)
                while time.perf_counter() < turn_ends:
                    turn = min(turn, _forward_backward(device, precision, forward, leaves))
                if rounds:
                    fastest[precision][name].append(turn)
    # Without fp32 in the same rounds, a precision's spread is that of its own rounds.
    baseline = fastest.get(REFERENCE)
    return {
        p: {
            name: KernelTime(
                min(times) * 1e3,
                kernels[name][2] / min(times) / 1e12,
                ratio_spread(baseline[name] if baseline else [min(times)] * len(times), times),
            )
            for name, times in fastest[p].items()
        }
        for p in precisions
    }


def remember(device: torch.device, timings: dict[str, Timing], again: bool = False) -> None:
    """Cache ``timings`` for later runs on this device and torch version; ``again``: they
    replace timings whose spread was wide (``probe``)."""
    measured_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    write_entries(
        CACHE_FILE,
        {
            cache_key(device, p): {
                "kernels": {name: vars(k) for name, k in t.items()},
                "measured_at": measured_at,
                "measured_again": again,
            }
            for p, t in timings.items()
        },
    )


def stale_timings(found: dict[str, Timing]) -> str | None:
    """Why cached timings cannot be measurements, or None: each kernel's time a finite number
    of at least ``MIN_PLAUSIBLE_MS``, within ``PLAUSIBLE_RATIO`` of fp32's, and each rate a
    positive number."""
    for kernel in KERNELS:
        ms = {p: timing[kernel].ms for p, timing in found.items()}
        for name, value in ms.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number and math.isfinite(value) and value >= MIN_PLAUSIBLE_MS):
                return f"{kernel}: {name} took {value!r} ms"
        base = ms.get(REFERENCE)
        for name, value in ms.items():
            if base and not 1 / PLAUSIBLE_RATIO <= value / base <= PLAUSIBLE_RATIO:
                return f"{kernel}: {name} took {value / base:.3g}x {REFERENCE}'s time"
    rates = [k.tflops for timing in found.values() for k in timing.values()]
    if not all(isinstance(r, (int, float)) and math.isfinite(r) and r > 0 for r in rates):
        return "a kernel's TFLOP/s is not a positive number"
    return None


def probe(
    device: torch.device, precisions: Iterable[str], refresh: bool = False
) -> dict[str, Timing]:
    """Each precision's timing, from the cache where it holds one, else measured and cached.

    Cached timings whose spread is wider than ``WIDE_SPREAD`` are measured again, once: on a
    machine this noisy a second measurement is no steadier, and each costs seconds (17 s on
    the shared 2-core CPU here), so the second is kept, with its spread, for later runs."""
    precisions = list(precisions)
    cached = {} if refresh else read_entries(CACHE_FILE)
    found: dict[str, Timing] = {}
    measured_again = False
    for precision in precisions:
        entry = cached.get(cache_key(device, precision))
        # An entry of an older amp_exp, without a spread, raises KeyError: measured again.
        with contextlib.suppress(KeyError, TypeError):
            cells = entry["kernels"]
            found[precision] = {k: KernelTime(**{f: cells[k][f] for f in FIELDS}) for k in KERNELS}
            measured_again |= entry.get("measured_again") is True
    if stale := stale_timings(found):
        log.warning(
            "%s holds timings that are no measurement (%s); measuring again",
            cache_dir() / CACHE_FILE,
            stale,
        )
        found = {}
    wide = max((k.spread for timing in found.values() for k in timing.values()), default=0)
    measure_again = wide > WIDE_SPREAD and not measured_again
    if measure_again:
        log.info(
            "the cached probe speeds lie %.0f%% from their typical round, more than %.0f%%; "
            "measuring again",
            100 * wide,
            100 * WIDE_SPREAD,
        )
        found = {}
    if any(p not in found for p in precisions):
        # All of them: a speed is a ratio to fp32's time, measured in the same rounds.
        log.info(
            "measuring %s forward+backward speed on %s (once; cached for later runs)",
            ", ".join(precisions),
            device_name(device),
        )
        found = measure(device, precisions)
        remember(device, found, measure_again)
    return found
