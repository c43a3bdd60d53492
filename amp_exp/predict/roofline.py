"""A traced step's cost on a named device in each precision: a roofline, op by op.

Each op takes max(FLOPs / (peak x efficiency), bytes / (HBM bandwidth x efficiency)) plus one
kernel launch; the step is the sum (no overlap of ops, nor of communication with compute). A
GEMM's efficiency depends on its shape (gemm_efficiency: wave quantization over the device's SMs,
tile padding, the main loop's fill), a convolution's on its implicit GEMM's. A run the runner
compiles (trainer.compile=true, or auto for a precision that needs it on CUDA: fp8) fuses each
run of memory-bound ops into one kernel, and fp8's casts with them. The precision's row of the
precision table (config/precisions.py) says what changes:

- matmuls run at the dense peak of ``peak_math`` (training/flops.py: fp32 as TF32 when allowed);
  under fp8 the converted linears' three matmuls (forward, input and weight gradient) run at the
  fp8 peak with 1-byte operands, and every other matmul at the compute dtype's;
- memory-bound ops move the compute dtype's bytes per element, except the loss and the layers
  every precision keeps in fp32 (norms), which move fp32's;
- the casts a precision adds are their own line: autocast's weight casts (each step, each way),
  the fp32 boundary at the loss and the norms, and fp8's quantization of each operand of each
  matmul (an amax pass, then a scaled cast per use);
- the optimizer reads and writes every parameter, gradient and state element once per step
  (and GradScaler's unscale every gradient once more).

A record gives a step time only where the device has the precision's math in hardware
(``supported``), the run fits in its memory (``fits``) and the runner can train it; elsewhere
``why`` says which, and the times are null. fp8 at world_size > 1 is predicted as FSDP2 runs it
(torchtitan's float8), which amp_exp's fp8 (DDP only) does not: its record says so (``caveat``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from amp_exp.config.adaptive import COMPILE_AUTO
from amp_exp.config.precisions import PrecisionSpec, get
from amp_exp.config.schema import AdamWConfig, RunConfig, Strategy
from amp_exp.devices import Device
from amp_exp.predict.trace import Op, StepTrace
from amp_exp.training.flops import peak_math
from amp_exp.training.linears import plan_linears
from amp_exp.training.precisions.fp8 import Fp8Recipe

# A large, well-shaped GEMM reaches this share of the dense datasheet peak: torchao's float8
# roofline (torchao/testing/training/roofline_utils.py, "based on experimental observation with
# sample large inputs" on an H100) took 78% for bf16 and fp8 alike; assumed for every device,
# dtype and math. Another version of that file takes 69% for bf16 and 78% for fp8 and fuses
# fp8's amax into the operand's producer; with those, or with 69% for both and that fusion, the
# rows of published.json not held out put fp8's speedups 15% or 9% high (median), against 3%
# with neither (docs/hardware.md). Smaller and skinnier GEMMs reach
# less (gemm_efficiency). Elementwise and reduction kernels reach about 80% of HBM bandwidth.
LARGE_GEMM_EFFICIENCY = 0.78
MEMORY_EFFICIENCY = 0.8
# Fused attention's share of the dense peak, by device: PyTorch's SDPA flash backend is
# FlashAttention-2, which reaches 50-73% of an A100's peak (Dao 2023, "FlashAttention-2",
# abstract; the low end taken) and "only 35% utilization on the H100" (Shah et al. 2024,
# "FlashAttention-3", abstract): it issues Ampere's mma instructions, none of Hopper's wgmma or
# TMA. The H200 has the H100's SMs; the B200 is assumed alike (FA2 uses no tcgen05 either).
ATTENTION_EFFICIENCY = {"a100": 0.5, "h100": 0.35, "h200": 0.35, "b200": 0.35}
# Batch norm in training reduces over the whole batch before it can normalise one element, so
# it reads its inputs twice: statistics, then normalisation; backward, a reduction over dY and
# X, then dX from both (PyTorch's CUDA kernels: batch_norm_collect_statistics and
# batch_norm_elemt, batch_norm_backward_reduce and batch_norm_backward_elemt). Compiled, the
# reduction starts a new fused kernel for the same reason.
TWO_PASS = {"native_batch_norm", "native_batch_norm_backward"}
# The output tiles one SM computes one at a time, and one step of the main loop along K: 128 x
# 128 x 64 is typical of cuBLAS's and CUTLASS's Tensor Core kernels on Ampere and Hopper, and the
# libraries carry narrower tiles for narrow outputs (a convolution's 24 output channels). The
# roofline takes whichever tile loses least to padding and waves, each at the large-GEMM
# efficiency (optimistic for the small ones); assumed for every device and dtype.
TILES = ((128, 128), (128, 64), (64, 128), (64, 64), (128, 32), (32, 128))
TILE_K = 64
# cuBLAS splits K across SMs when the output has fewer tiles than the device has SMs, each split
# at least this many steps of the main loop deep.
SPLIT_K_MIN_STEPS = 4
# A GEMM narrower than one Tensor Core instruction in N or K (depthwise and narrow grouped
# convolutions) runs on the CUDA cores, at the fp32 peak.
MMA_WIDTH = 16
# A kernel launch and its tail, in eager PyTorch: the floor under every op, which a tiny model's
# step is made of.
KERNEL_OVERHEAD_S = 5e-6
# The share of HBM a run may fill: the CUDA context, cuBLAS workspaces, the caching allocator's
# fragmentation and the largest op's transient buffers take the rest.
USABLE_MEMORY = 0.9
ATTENTION = {"_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward"}

ASSUMPTIONS = (
    f"a large GEMM at {LARGE_GEMM_EFFICIENCY:.0%} of the dense datasheet peak, less by shape: "
    "output tiles of 128x128 down to 32x128, whichever loses least, one per SM at a time (the "
    "last wave's idle SMs and the tiles' padding past M and N are lost), K in steps of "
    f"{TILE_K} with one step's fill, K split "
    "across idle SMs when the tiles are fewer than the SMs; a convolution as its implicit GEMM; "
    f"narrower than {MMA_WIDTH} in N or K on the CUDA cores; fused attention at "
    "FlashAttention-2's share of the peak ("
    + ", ".join(f"{key} {share:.0%}" for key, share in ATTENTION_EFFICIENCY.items())
    + "), memory-bound ops "
    f"at {MEMORY_EFFICIENCY:.0%} of HBM bandwidth, batch norm reading its inputs twice, "
    f"{KERNEL_OVERHEAD_S * 1e6:g} us launch overhead per kernel",
    "eager (trainer.compile=false, or auto for a precision that runs eagerly): every aten op "
    "reads its inputs from and writes its outputs to HBM; compiled (trainer.compile=true, or auto "
    "for fp8 on CUDA): each run of memory-bound ops between two matmuls is one kernel that reads "
    "the first op's inputs and writes every op's outputs, the norms' and the loss's fp32 casts "
    "fuse into it, and fp8's two casts of an operand are one kernel; ops and communication do "
    "not overlap",
    "activations saved for the backward in the compute dtype (fp32 in the loss and norms); fp8 "
    "saves them in bf16 as torchao's Float8Linear does",
    "trainer.activation_checkpointing=true: each block recomputes its forward in the backward "
    "(traced as it runs) and keeps only its input; the activations of the one block being "
    "recomputed are not counted",
    f"a run fits when weights, gradients, optimizer state and saved activations fill at most "
    f"{USABLE_MEMORY:.0%} of HBM",
    "world_size > 1: FSDP2 shards weights, gradients and optimizer state; each step all-gathers "
    "the parameters twice (forward, backward) and reduce-scatters the gradients at "
    "predict.interconnect_gb_per_s, with (world_size - 1) / world_size of the bytes on the wire",
    "fp8's tensorwise recipe scales each operand of a converted linear once (one amax pass, a "
    "cast per matmul it feeds); rowwise scales each per row along the axis each matmul "
    "reduces over, so each operand takes an amax pass and a cast per matmul, each matmul "
    "reads its per-row scales, and the backward's GEMMs (cuBLAS's tensorwise kernel) are "
    "rescaled after, a pass over each output (compiled: the weight gradient's only); "
    "rowwise_with_gw_hp computes the weight gradient in bf16 from unscaled operands, so X and "
    "dY are cast once and that GEMM runs at the bf16 peak; a converted GEMM reads the format's "
    "elements (a byte, half in the 4-bit formats; block scales not counted) and writes bf16; a "
    "block-scaled format casts each operand twice (two kernels, no amax pass), whatever the "
    "recipe",
)


@dataclass(frozen=True)
class Cost:
    name: str
    seconds: float
    bound: str  # "compute", "memory" or "launch" (or "network" for communication)


def gemm_efficiency(m: int, n: int, k: int, sms: int) -> float:
    """The share of the dense peak a GEMM with an M x N output and depth K reaches on a device
    with ``sms`` SMs, with the tile that loses least: the large-GEMM efficiency, times the SMs'
    occupancy over the waves of tiles (after splitting K where the tiles are too few), times the
    share of each tile inside M x N, times the main loop's share of each split (one step of
    fill)."""
    return max(tile_efficiency(m, n, k, sms, tile) for tile in TILES)


def tile_efficiency(m: int, n: int, k: int, sms: int, tile: tuple[int, int]) -> float:
    rows, columns = math.ceil(m / tile[0]), math.ceil(n / tile[1])
    tiles = rows * columns
    splits = max(1, min(sms // tiles, k // (SPLIT_K_MIN_STEPS * TILE_K)))
    work = tiles * splits
    occupancy = work / (math.ceil(work / sms) * sms)
    padding = m * n / (rows * tile[0] * columns * tile[1])
    depth = k / splits
    return LARGE_GEMM_EFFICIENCY * occupancy * padding * depth / (depth + TILE_K)


def op_cost(op: Op, nbytes: float, tflops: float, device: Device) -> Cost:
    """One traced op: its FLOPs at the efficiency of its kind and shape, its bytes at the HBM's,
    whichever is slower, plus a launch."""
    if op.name in ATTENTION:
        compute = op.flops / (tflops * 1e12 * ATTENTION_EFFICIENCY[device.key])
    elif op.mnk and min(op.mnk[1], op.mnk[2]) < MMA_WIDTH:
        compute = op.flops / (device.tflops["fp32"] * 1e12 * LARGE_GEMM_EFFICIENCY)
    elif op.mnk:
        compute = op.flops / (tflops * 1e12 * gemm_efficiency(*op.mnk, device.sms))
    else:
        compute = op.flops / (tflops * 1e12 * LARGE_GEMM_EFFICIENCY)
    memory = nbytes / (device.hbm_tb_per_s * 1e12 * MEMORY_EFFICIENCY)
    busy = max(compute, memory)
    bound = "compute" if compute >= memory else "memory"
    if busy < KERNEL_OVERHEAD_S:
        bound = "launch"
    return Cost(label(op), busy + KERNEL_OVERHEAD_S, bound)


def memory_op(name: str, nbytes: float, device: Device, kernels: int = 1) -> Cost:
    seconds = nbytes / (device.hbm_tb_per_s * 1e12 * MEMORY_EFFICIENCY)
    return Cost(name, seconds + kernels * KERNEL_OVERHEAD_S, "memory")


@dataclass
class Setting:
    """What a precision changes, resolved for one run."""

    spec: PrecisionSpec
    matmul_math: str  # the peak most matmuls run at
    fp8_linears: frozenset[str]
    act_bytes: int
    # The runner compiles it (build.compiles, on a CUDA device): memory-bound ops fuse.
    compiled: bool
    recipe: Fp8Recipe
    # Bytes per element of a converted GEMM's operands: 1 in fp8 and MXFP8, 0.5 in the 4-bit
    # formats (their per-block scales are not counted).
    element_bytes: float
    # A block-scaled format (MXFP8, MXFP4, NVFP4): scaled block by block, not by fp8's recipe.
    block_scaled: bool
    # Each converted linear's forward GEMM: M (tokens or pixels), N (outputs), K (inputs).
    linear_shapes: dict[str, tuple[int, int, int]]


def setting(cfg: RunConfig, trace: StepTrace, precision: str) -> Setting:
    plugin = get(precision)
    spec = plugin.spec
    math_name = peak_math(precision, cfg.trainer.tf32)
    fp8_linears: frozenset[str] = frozenset()
    recipe = Fp8Recipe.tensorwise
    # A precision that converts linears (fp8) runs those its filters admit at its peak.
    if spec.engaged.converted_dtypes:
        options = plugin.options_for(cfg.precision)
        recipe = getattr(options, "recipe", recipe)
        skip_small = recipe.value if getattr(options, "skip_small", False) else None
        plan = plan_linears(trace.model, options.skip, skip_small, cfg.precision.keep_fp32)
        fp8_linears = frozenset(plan.converted)
        math_name = spec.compute_dtype.short
    choice = cfg.trainer.compile
    compiled = spec.compile_on_cuda if choice == COMPILE_AUTO else bool(choice)
    shapes: dict[str, tuple[int, int, int]] = {}
    for op in trace.ops:
        if op.linear in fp8_linears and op.phase == "forward":
            shapes.setdefault(op.linear, op.mnk)
    return Setting(
        spec,
        math_name,
        fp8_linears,
        spec.compute_dtype.itemsize,
        compiled,
        recipe,
        min((d.itemsize for d in spec.engaged.converted_dtypes), default=1),
        any(d.block_scaled for d in spec.engaged.converted_dtypes),
        shapes,
    )


def gemm_role(op: Op, forward: tuple[int, int, int]) -> str:
    """Which of a linear's three GEMMs ``op`` is, by its shape beside the forward's (M, N, K):
    the output (the forward, or its recomputation under checkpointing), the input gradient
    (reduces over N) or the weight gradient (reduces over the M tokens). Where M equals N the
    two gradients have one shape; the tie goes to the input gradient."""
    if op.phase == "forward" or op.mnk == forward:
        return "output"
    return "grad_weight" if op.mnk[2] == forward[0] != forward[1] else "grad_input"


def in_fp8(op: Op, run: Setting) -> bool:
    """Whether a matmul runs in the converted format: every GEMM of a converted linear, but
    rowwise_with_gw_hp's weight gradient, which torchao computes in the high precision from
    the unscaled input and output gradient."""
    if op.linear not in run.fp8_linears:
        return False
    if run.recipe is not Fp8Recipe.rowwise_with_gw_hp:
        return True
    return gemm_role(op, run.linear_shapes[op.linear]) != "grad_weight"


def missing_math(device: Device, precision: str, tf32: bool) -> str | None:
    """Why ``device`` cannot run ``precision``'s matmuls in hardware, or None: a block-scaled
    format needs block-scaled Tensor Cores, whatever the peak of its element type."""
    block_scaled = any(d.block_scaled for d in get(precision).spec.engaged.matmul_dtypes)
    if block_scaled and not device.block_scaled:
        return f"{device.label} has no block-scaled (MX) Tensor Cores"
    needed = peak_math(precision, tf32)
    if needed == "tf32" and "tf32" not in device.tflops:
        needed = "fp32"
    if needed in device.tflops:
        return None
    return f"{device.label} has no {needed} Tensor Cores"


def caveat(cfg: RunConfig, run: Setting) -> str | None:
    """What the prediction stands for that the runner cannot start, or None."""
    if cfg.predict.world_size > 1 and Strategy.fsdp2 not in run.spec.strategies:
        allowed = ", ".join(sorted(s.value for s in run.spec.strategies))
        return (
            f"predicted under FSDP2, as torchtitan runs it; amp_exp trains {run.spec.name} "
            f"under {allowed} only"
        )
    return None


def format_flop_share(trace: StepTrace, run: Setting) -> float | None:
    """The share of the step's matmul FLOPs that run in the precision's matmul format: the
    converted linears' under fp8 (and the block-scaled formats), else all but those in fp32."""
    total = sum(op.flops for op in trace.ops)
    if not total:
        return None
    if run.spec.engaged.converted_dtypes:
        covered = sum(op.flops for op in trace.ops if op.linear in run.fp8_linears)
    else:
        covered = sum(op.flops for op in trace.ops if not op.fp32)
    return covered / total


def label(op: Op) -> str:
    """An op by what it is, its phase and its GEMM shape: alike ops share a label."""
    shape = f" {op.mnk[0]}x{op.mnk[1]}x{op.mnk[2]}" if op.mnk else ""
    return f"{op.name} {op.phase}{shape}"


def op_bytes(op: Op, run: Setting) -> tuple[float, float]:
    """The bytes an op reads and writes in the precision: the format's operands for converted
    matmuls (1 byte in fp8, half in fp4; their output in the activation dtype), fp32 in the loss
    and the norms, the activation dtype elsewhere (batch norm reading its inputs twice)."""
    if in_fp8(op, run):
        return op.read * run.element_bytes, op.written * run.act_bytes
    width = 4 if op.fp32 else run.act_bytes
    passes = 2 if op.name in TWO_PASS else 1
    return op.read * width * passes, op.written * width


def fused(ops: list[Op], run: Setting, device: Device) -> Cost:
    """A compiled run of memory-bound ops as one kernel: it reads what the first op reads and
    writes every op's output (the intermediates a later op or the backward may need)."""
    read = op_bytes(ops[0], run)[0]
    written = sum(op_bytes(op, run)[1] for op in ops)
    return memory_op(f"fused from {ops[0].name} {ops[0].phase}", read + written, device)


def traced_costs(trace: StepTrace, run: Setting, device: Device) -> list[Cost]:
    costs: list[Cost] = []
    chain: list[Op] = []
    for op in trace.ops:
        fusable = run.compiled and not op.flops
        if chain and not (fusable and op.phase == chain[0].phase and op.name not in TWO_PASS):
            costs.append(fused(chain, run, device))
            chain = []
        if fusable:
            chain.append(op)
            continue
        math_name = run.spec.peak_math if in_fp8(op, run) else run.matmul_math
        costs.append(op_cost(op, sum(op_bytes(op, run)), device.tflops[math_name], device))
    if chain:
        costs.append(fused(chain, run, device))
    return costs


def cast_cost(trace: StepTrace, run: Setting, device: Device) -> Cost | None:
    """Autocast's casts: each linear weight to the compute dtype in the forward and its gradient
    back to fp32 in the backward; activations across every fp32 boundary (norm outputs, the
    logits into the loss), each way."""
    spec = run.spec
    if spec.autocast_dtype is None:
        return None
    low = run.act_bytes
    weights = sum(n for name, n in trace.linear_weights.items() if name not in run.fp8_linears)
    # Compiled, the activations' casts fuse into the norms and the loss (traced_costs).
    norms = [
        op.written
        for op in trace.ops
        if op.fp32 and not op.loss and op.phase == "forward" and not run.compiled
    ]
    logits = 0 if run.compiled else next((op.read for op in trace.ops if op.loss), 0)
    elements = 2 * (weights + sum(norms) + logits)
    kernels = 2 * (len(trace.linear_weights) - len(run.fp8_linears) + len(norms) + 1)
    return memory_op("autocast casts", elements * (4 + low), device, kernels)


# Per recipe, for a converted linear's input X, weight W and output gradient dY: (amax passes,
# scaled casts), as torchao's Float8LinearConfig.from_recipe_name sets them up. Tensorwise: one
# scale per tensor, so one amax and a cast per matmul the operand feeds. Rowwise: each matmul
# reduces over another axis, so an amax and a cast per matmul. rowwise_with_gw_hp: the weight
# gradient takes X and dY unscaled in the high precision, so each is scaled once (for the
# forward and the input gradient), and W twice (rowwise for the forward, tensorwise for the
# input gradient).
SCALINGS = {
    Fp8Recipe.tensorwise: ((1, 2), (1, 2), (1, 2)),
    Fp8Recipe.rowwise: ((2, 2), (2, 2), (2, 2)),
    Fp8Recipe.rowwise_with_gw_hp: ((1, 1), (2, 2), (1, 1)),
}
# A block-scaled format takes each block's scale from the block's own amax inside the cast
# kernel (no amax pass), and casts each operand along each GEMM's reduction axis: two casts,
# which torchao's roofline (roofline_utils.py, its MX recipes) takes as two kernels, each
# reading the operand, compiled or not.
BLOCK_SCALED_CASTS = ((0, 2), (0, 2), (0, 2))


def quantize_cost(trace: StepTrace, run: Setting, device: Device, recipe: Fp8Recipe) -> Cost | None:
    """The dynamic scaling of each converted linear, fp8's by its recipe (SCALINGS), a
    block-scaled format's block by block (BLOCK_SCALED_CASTS): each amax pass and each cast
    reads the operand (X and dY in the activation dtype, W from the fp32 master), each cast
    writes the format's element (a byte in fp8, half in fp4); compiled, an operand's casts are
    one kernel that reads it once. Under a rowwise recipe each matmul reads its operands' fp32
    per-row scales, and the backward's two GEMMs, which torchao runs with slow accumulation on
    cuBLAS's tensorwise kernel (its rowwise CUTLASS kernel is slow there), are multiplied by
    their scales after: a pass over each output. Compiled, the input gradient's multiply fuses
    into its consumer; the weight gradient's is the backward graph's output, a pass of its
    own."""
    if not run.fp8_linears:
        return None
    plan = BLOCK_SCALED_CASTS if run.block_scaled else SCALINGS[recipe]
    one_read = run.compiled and not run.block_scaled
    per_row = recipe is not Fp8Recipe.tensorwise and not run.block_scaled
    nbytes = 0.0
    kernels = 0
    for m, n, k in run.linear_shapes.values():
        operands = (((m, k), run.act_bytes), ((n, k), 4), ((m, n), run.act_bytes))
        for ((rows, columns), source), (amax_passes, casts) in zip(operands, plan, strict=True):
            cast_kernels = 1 if one_read else casts
            nbytes += rows * columns * ((amax_passes + cast_kernels) * source)
            nbytes += rows * columns * casts * run.element_bytes
            kernels += amax_passes + cast_kernels
            if per_row:
                nbytes += casts * 4 * (rows + columns)  # a scale per row, read by each matmul
        if recipe is Fp8Recipe.rowwise and not run.block_scaled:
            rescaled = [(n, k)] if run.compiled else [(m, k), (n, k)]
            nbytes += sum(2 * rows * columns * run.act_bytes for rows, columns in rescaled)
            kernels += len(rescaled)
    return memory_op("fp8 quantization", nbytes, device, kernels)


def optimizer_slots(cfg: RunConfig) -> int:
    """State tensors per parameter: AdamW's two moments, SGD's momentum buffer if any."""
    if isinstance(cfg.optimizer, AdamWConfig):
        return 2
    return 1 if cfg.optimizer.momentum else 0


def optimizer_cost(cfg: RunConfig, trace: StepTrace, run: Setting, device: Device) -> Cost:
    weight = run.spec.weight_dtype.itemsize
    state = run.spec.optimizer_state_dtype.itemsize
    slots = optimizer_slots(cfg)
    # Read parameter, gradient and state; write parameter and state. GradScaler first unscales
    # the gradients in place (a read and a write each).
    per_element = (
        2 * weight + weight + 2 * slots * state + (2 * weight if run.spec.grad_scaler else 0)
    )
    shard = trace.parameters / cfg.predict.world_size
    return memory_op("optimizer step", shard * per_element, device)


def comm_cost(cfg: RunConfig, trace: StepTrace, run: Setting) -> Cost | None:
    world = cfg.predict.world_size
    if world == 1:
        return None
    spec = run.spec
    cast = cfg.precision.fsdp_cast_params and spec.fsdp_param_dtype is not None
    gathered = (spec.fsdp_param_dtype if cast else spec.weight_dtype).itemsize
    reduced = spec.reduce_dtype.itemsize
    wire = (world - 1) / world * trace.parameters * (2 * gathered + reduced)
    return Cost(
        "FSDP2 all-gather + reduce-scatter",
        wire / (cfg.predict.interconnect_gb_per_s * 1e9),
        "network",
    )


def memory_bytes(cfg: RunConfig, trace: StepTrace, run: Setting) -> dict[str, int]:
    shard = math.ceil(trace.parameters / cfg.predict.world_size)
    weights = shard * run.spec.weight_dtype.itemsize
    return {
        "weights": weights,
        "grads": weights,
        "optimizer": shard * optimizer_slots(cfg) * run.spec.optimizer_state_dtype.itemsize,
        "activations": trace.saved_elements * run.act_bytes + trace.saved_fp32_elements * 4,
    }


def max_batch(memory: dict[str, int], batch: int, device: Device) -> int:
    """The largest batch whose saved activations fit beside the static state (activations grow
    linearly with the batch)."""
    room = USABLE_MEMORY * device.memory_gb * 1e9 - memory["weights"] - memory["grads"]
    room -= memory["optimizer"]
    per_sample = memory["activations"] / batch
    return max(0, math.floor(room / per_sample)) if per_sample else 0


def top_ops(costs: list[Cost], count: int = 5) -> list[dict]:
    """The costliest ops, alike ones (same op, phase and GEMM shape) summed."""
    grouped: dict[str, list] = {}
    for cost in costs:
        seconds, times, _ = grouped.get(cost.name, (0.0, 0, cost.bound))
        grouped[cost.name] = [seconds + cost.seconds, times + 1, cost.bound]
    ranked = sorted(grouped.items(), key=lambda item: -item[1][0])[:count]
    return [
        {"op": name, "seconds": seconds, "count": times, "bound": bound}
        for name, (seconds, times, bound) in ranked
    ]


def step_costs(cfg: RunConfig, trace: StepTrace, run: Setting, device: Device) -> list[Cost]:
    """Every cost of one step: the traced ops, then the casts, fp8's quantization, the
    optimizer and FSDP2's collectives. It does not ask whether the run fits (predict_one does)."""
    extra = [
        cast_cost(trace, run, device),
        quantize_cost(trace, run, device, run.recipe),
        optimizer_cost(cfg, trace, run, device),
        comm_cost(cfg, trace, run),
    ]
    return traced_costs(trace, run, device) + [c for c in extra if c is not None]


def predict_one(cfg: RunConfig, trace: StepTrace, device: Device, precision: str) -> dict:
    """One device and precision: whether it is supported, fits and would train (``why`` not),
    then the step's time, what bounds it, its memory and largest batch; the times are null
    where it would not run."""
    run = setting(cfg, trace, precision)
    memory = memory_bytes(cfg, trace, run)
    needed, usable = sum(memory.values()), USABLE_MEMORY * device.memory_gb * 1e9
    unsupported = missing_math(device, precision, cfg.trainer.tf32)
    fits = needed <= usable
    why = (
        (unsupported and f"no hardware support: {unsupported}")
        or (
            not fits
            and f"does not fit: needs {needed / 1e9:.3g} GB of {usable / 1e9:.3g} GB "
            f"({USABLE_MEMORY:.0%} of {device.memory_gb:g} GB)"
        )
        # As training refuses it: no matmul would run in the format.
        or (
            run.spec.engaged.converted_dtypes
            and not run.fp8_linears
            and f"{run.spec.name} converts no linear layer of this model"
        )
    )
    record = {
        "supported": unsupported is None,
        "fits": fits,
        "why": why or None,
        "caveat": caveat(cfg, run),
        "format_flop_share": format_flop_share(trace, run),
        "memory_bytes": memory,
        "max_batch": max_batch(memory, trace.batch_size, device),
        "fp8_linears": len(run.fp8_linears),
        "step_time_s": None,
        "samples_per_s": None,
        # tokens_per_s for a language model (samples_per_s again for images, 1 unit a sample).
        f"{trace.unit}_per_s": None,
    }
    if why:
        return record
    costs = step_costs(cfg, trace, run, device)
    step = sum(c.seconds for c in costs)
    by_bound = defaultdict(float)
    for cost in costs:
        by_bound[cost.bound] += cost.seconds
    samples = trace.batch_size / step
    return {
        **record,
        "step_time_s": step,
        "samples_per_s": samples,
        f"{trace.unit}_per_s": samples * trace.units_per_sample,
        "bound_share": {bound: seconds / step for bound, seconds in sorted(by_bound.items())},
        "casts_s": sum(
            c.seconds for c in costs if c.name in {"autocast casts", "fp8 quantization"}
        ),
        "top_ops": top_ops(costs),
    }
