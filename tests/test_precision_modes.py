"""Precision beyond autocast: pure bf16 with stochastic rounding (bf16_true), and fp8."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from amp_exp.capability.device import check_request
from amp_exp.config.precisions import auto_candidates
from amp_exp.config.preflight import CONF_DIR, CONFIG_NAME
from amp_exp.config.schema import GPTConfig, PrecisionConfig
from amp_exp.config.values import validate
from amp_exp.errors import ConfigError
from amp_exp.report.assemble import build_report
from amp_exp.results.resume import config_changes
from amp_exp.run import train
from amp_exp.tasks.gpt import GPT
from amp_exp.tasks.vision_models import TinyCNN
from amp_exp.training.linears import plan_linears
from amp_exp.training.precisions.base import LinearOptions, create
from amp_exp.training.precisions.fp8 import require_fp8_hardware
from amp_exp.training.stochastic_rounding import (
    StochasticRoundingStep,
    round_to_bf16_stochastically,
)
from helpers.runs import FAST, read_jsonl
from helpers.warm_python import python_m

BLOCK_LINEARS = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")

# --- stochastic rounding ------------------------------------------------------------------------


def test_stochastic_rounding_lands_on_a_neighbour_and_is_unbiased() -> None:
    torch.manual_seed(0)
    # 1 + 2^-10 lies an eighth of the way from bf16's 1 to its next value, 1 + 2^-7.
    x = torch.full((200_000,), 1 + 2**-10)
    rounded = round_to_bf16_stochastically(torch.cat([x, -x]))
    assert rounded.dtype == torch.bfloat16
    up, down = rounded[: x.numel()].float(), rounded[x.numel() :].float()
    assert set(up.unique().tolist()) == {1.0, 1 + 2**-7}
    assert set(down.unique().tolist()) == {-1.0, -(1 + 2**-7)}
    # Rounds up with probability 1/8: the mean is x within 4 standard errors.
    stderr = 2**-7 * (1 / 8 * 7 / 8 / x.numel()) ** 0.5
    assert abs(up.mean().item() - x[0].item()) < 4 * stderr
    assert abs(down.mean().item() + x[0].item()) < 4 * stderr


def test_stochastic_rounding_leaves_bf16_values_alone_and_repeats_under_a_seed() -> None:
    exact = torch.tensor([0.0, 1.0, -2.5, 3.0e38, -1e-30, float("inf")]).bfloat16().float()
    assert torch.equal(round_to_bf16_stochastically(exact).float(), exact)
    x = torch.randn(1000)
    torch.manual_seed(1)
    first = round_to_bf16_stochastically(x)
    torch.manual_seed(1)
    assert torch.equal(round_to_bf16_stochastically(x), first)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_updates_below_half_a_bf16_step_move_weights_only_with_stochastic_rounding(
    momentum,
) -> None:
    def train_ones(stochastic: bool) -> tuple[torch.Tensor, torch.optim.Optimizer]:
        torch.manual_seed(0)
        weight = nn.Parameter(torch.ones(20_000, dtype=torch.bfloat16))
        # Each update is 2^-10, an eighth of bf16's step above 1.
        optimizer = torch.optim.SGD([weight], lr=2**-10 * (1 - momentum), momentum=momentum)
        rounding = StochasticRoundingStep()
        for _ in range(16):
            weight.grad = torch.ones_like(weight)
            rounding.step(optimizer) if stochastic else optimizer.step()
        return weight, optimizer

    nearest, _ = train_ones(stochastic=False)
    assert torch.equal(nearest, torch.ones_like(nearest))  # every update rounded away
    weight, optimizer = train_ones(stochastic=True)
    assert weight.dtype == weight.grad.dtype == torch.bfloat16
    if momentum:
        assert optimizer.state[weight]["momentum_buffer"].dtype == torch.bfloat16
    moved = 1 - weight.float().mean().item()
    # Step k moves 2^-10 (1 - momentum^k): the buffer's average building up to the gradient.
    expected = 2**-10 * sum(1 - momentum**k for k in range(1, 17))
    assert moved == pytest.approx(expected, rel=0.05)


class FreshAllocations(TorchDispatchMode):
    """Counts the bytes of the tensors that ops allocate while it is active, as they live and
    die: ``peak`` is the most held at once. Views and in-place results allocate nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        results = out if isinstance(out, (tuple, list)) else (out,)
        for result, returned in zip(results, func._schema.returns, strict=False):
            if isinstance(result, torch.Tensor) and returned.alias_info is None:
                storage = result.untyped_storage()
                self.live += storage.nbytes()
                weakref.finalize(storage, self._freed, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def test_stochastic_rounding_holds_fp32_copies_of_one_parameter_at_a_time() -> None:
    """AdamW in fp32 needs the parameter, its gradient and two moments: 16 bytes an element.
    Of eight equal bf16 parameters the rounding step holds that for one at a time (with the
    optimizer's and the rounding's temporaries), never for all eight as AMP's masters do."""
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(64, 64, bias=False) for _ in range(8)).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(layers.parameters(), lr=1e-3, foreach=True)
    rounding = StochasticRoundingStep()
    for _ in range(2):  # the first step creates the moments
        for p in layers.parameters():
            p.grad = torch.randn_like(p)
        with FreshAllocations() as allocations:
            rounding.step(optimizer)
    one_parameter_in_fp32 = 16 * 64 * 64
    assert allocations.peak < 2 * one_parameter_in_fp32
    assert {s.dtype for state in optimizer.state.values() for s in state.values()} == {
        torch.bfloat16,
        torch.float32,  # the step count
    }


def test_the_step_count_of_a_0d_parameter_is_not_rounded_to_bf16() -> None:
    """A 0-d parameter's moments are shaped like AdamW's step count; only the moments round."""
    weight = nn.Parameter(torch.tensor(1.0, dtype=torch.bfloat16))
    optimizer = torch.optim.AdamW([weight], lr=1e-4)
    rounding = StochasticRoundingStep()
    for _ in range(301):  # bf16 holds no odd number above 256
        weight.grad = torch.ones_like(weight)
        rounding.step(optimizer)
    state = optimizer.state[weight]
    assert (state["step"].dtype, state["step"].item()) == (torch.float32, 301.0)
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16


# --- model preparation --------------------------------------------------------------------------


def test_bf16_true_model_keeps_norm_layers_fp32_and_hands_back_fp32_logits() -> None:
    bf16_true = create("bf16_true", PrecisionConfig(name="bf16_true"), torch.device("cpu"))
    model = bf16_true.convert_module(TinyCNN(3, 10, width=4))
    assert model.features[0].weight.dtype == torch.bfloat16
    assert model.head.weight.dtype == torch.bfloat16
    norm = model.features[1]
    assert {norm.weight.dtype, norm.running_mean.dtype, norm.running_var.dtype} == {torch.float32}
    logits = model(torch.randn(2, 3, 8, 8))
    assert logits.dtype == torch.float32
    logits.sum().backward()
    assert model.head.weight.grad.dtype == torch.bfloat16


def test_fp8_keeps_linears_in_bf16_by_name_and_shape_and_says_why() -> None:
    """GPT's first linear is blocks.0.attn.qkv, which converts like any block's; its output
    head is kept by name. torchao's size thresholds keep all of a tiny model's."""
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=64, seq_len=16), vocab_size=120)
    plan = plan_linears(model, LinearOptions().skip)
    blocks = [f"blocks.{i}.{name}" for i in (0, 1) for name in BLOCK_LINEARS]
    assert plan.converted == blocks
    assert plan.skipped == {"lm_head": "precision.options.skip: lm_head"}

    model.blocks[1].mlp.fc = nn.Linear(64, 200)
    plan = plan_linears(model, ["blocks.0.*"], skip_small_for="tensorwise")
    assert plan.converted == []
    assert plan.skipped == {
        **{name: "precision.options.skip: blocks.0.*" for name in blocks[:4]},
        "blocks.1.attn.qkv": "64x192 below torchao's tensorwise size thresholds",
        "blocks.1.attn.proj": "64x64 below torchao's tensorwise size thresholds",
        "blocks.1.mlp.fc": "64x200 not multiples of 16",
        "blocks.1.mlp.proj": "256x64 below torchao's tensorwise size thresholds",
        "lm_head": "64x120 not multiples of 16",
    }


# --- what may run where -------------------------------------------------------------------------


def test_fp8_without_fp8_hardware_is_refused_unless_emulated() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match=r"compute capability 8\.9\+.*emulate=true"):
        require_fp8_hardware(cpu, emulate=False)
    require_fp8_hardware(cpu, emulate=True)
    check_request("bf16_true", cpu, PrecisionConfig())
    check_request("fp8", cpu, PrecisionConfig(emulate=True))
    # auto times and picks among the autocast family only.
    assert auto_candidates() == ("fp32", "bf16", "fp16")


def test_fp8_without_torchao_names_the_extra_to_install(run_cfg, compose_cfg, monkeypatch) -> None:
    monkeypatch.setattr("amp_exp.training.precisions.base.find_spec", lambda name: None)
    with pytest.raises(ConfigError) as error:
        validate(compose_cfg("precision=fp8", "precision.emulate=true"))
    assert str(error.value) == (
        "precision=fp8 needs torchao, which is not installed: pip install 'amp_exp[fp8]'"
    )
    run_cfg("precision=bf16_true")  # bf16_true needs no torchao on the CPU


@pytest.mark.slow
def test_fp8_on_the_cpu_without_emulation_is_a_one_line_error_with_exit_status_2(
    tmp_path,
) -> None:
    result = python_m(
        "amp_exp", "precision=fp8", "wandb.mode=disabled", f"hydra.run.dir={tmp_path}", timeout=300
    )
    assert result.returncode == 2
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "precision=fp8 needs a CUDA GPU" in errors[0]
    assert "Traceback" not in output


def test_bf16_true_and_fp8_checkpoints_do_not_resume_in_another_precision() -> None:
    for saved, current in [("bf16_true", "bf16"), ("fp8", "bf16"), ("bf16_true", "fp8")]:
        refused, _ = config_changes(
            {"precision": {"name": saved}}, {"precision": {"name": current}}
        )
        assert refused == [f'precision.name: "{saved}" -> "{current}"']
    knob = {"precision": {"name": "bf16_true", "options": {"stochastic_rounding": False}}}
    assert config_changes(knob, knob)[0] == []
    # Rounding to nearest instead is another experiment (results/resume.MAY_CHANGE).
    nearest = {"precision": {"name": "bf16_true", "options": {"stochastic_rounding": True}}}
    assert config_changes(knob, nearest)[0] == [
        "precision.options.stochastic_rounding: false -> true"
    ]


# --- training -----------------------------------------------------------------------------------

# A small learning rate on an MLP: the updates of most weights are below half a bf16 step. The
# diagnostics interval is the whole run.
STALL = [
    "model=mlp",
    "model.hidden_dim=64",
    "dataset.image_size=8",
    "trainer.max_steps=160",
    "trainer.log_every=40",
    "diagnostics.underflow_every=160",
    "trainer.eval_every=null",
    "scheduler=none",
    "optimizer.lr=0.0005",
]
# Within this distance of fp32's final training loss (a mean over the last 40 steps) a bf16_true
# run tracks fp32; over the 160 steps fp32's loss falls by about 0.15 from 2.30.
LOSS_TOLERANCE = 0.01


@pytest.fixture(scope="module")
def stall_runs(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    out = tmp_path_factory.mktemp("stall")
    runs = {}
    for name, precision in [
        ("fp32", "precision=fp32"),
        ("sr", "precision=bf16_true"),
        ("nearest", "precision=bf16_true_nearest"),
    ]:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = validate(compose(CONFIG_NAME, overrides=[*FAST, *STALL, precision]))
        runs[name] = (out / name, train(cfg, out / name))
    return runs


def test_plain_bf16_true_stalls_where_most_updates_round_away(stall_runs) -> None:
    path, nearest = stall_runs["nearest"]
    assert nearest["stale_weight_frac"] > 0.5
    assert nearest["final_loss"] - stall_runs["fp32"][1]["final_loss"] > 5 * LOSS_TOLERANCE
    row = [r for r in read_jsonl(path / "metrics.jsonl") if r["kind"] == "diagnostics"][-1]
    assert (row["step"], row["stale_window_steps"]) == (160, 160)
    assert row["stale_weight_frac"] == nearest["stale_weight_frac"]


def test_stochastic_rounding_moves_the_weights_and_tracks_fp32(stall_runs) -> None:
    fp32, sr = stall_runs["fp32"][1], stall_runs["sr"][1]
    assert sr["stale_weight_frac"] <= 0.05
    assert fp32["stale_weight_frac"] == 0.0
    assert abs(sr["final_loss"] - fp32["final_loss"]) <= LOSS_TOLERANCE


def test_bf16_true_halves_the_weight_and_optimizer_state_and_says_so_in_its_checks(
    stall_runs,
) -> None:
    fp32, sr = stall_runs["fp32"][1], stall_runs["sr"][1]
    # SGD with momentum: weights and momentum, 4 + 4 bytes per parameter in fp32, 2 + 2 in bf16.
    assert sr["state_bytes"] == fp32["state_bytes"] // 2
    assert sr["checks"]["master_weights_fp32"] == {
        "passed": None,
        "note": "bf16 by design (precision=bf16_true): no fp32 master copy",
    }
    assert sr["checks"]["unscaled_grads_fp32_finite"]["passed"] is True


def test_report_names_the_stall_and_compares_every_mode_with_fp32(stall_runs, tmp_path) -> None:
    report = build_report([path for path, _ in stall_runs.values()], tmp_path, 0.5)
    rows = {row["label"]: row for row in report["runs"]}
    assert set(rows) == {"fp32", "bf16_true", "bf16_true (nearest)"}
    assert rows["bf16_true (nearest)"]["precision"] == "bf16_true"
    assert rows["bf16_true"]["baseline"] is not None
    assert rows["bf16_true"]["state_ratio"] == 0.5
    stale = stall_runs["nearest"][1]["stale_weight_frac"]
    stall = (
        f"{stale:.0%} of weights did not move over the last interval: updates round away in "
        "bf16; use precision.options.stochastic_rounding=true"
    )
    (nearest,) = [v for v in report["verdicts"] if v.startswith("mlp: bf16_true (nearest)")]
    assert stall in nearest
    assert sum("did not move" in verdict for verdict in report["verdicts"]) == 1
    # The Runs table shows what the precision changes in memory: bf16_true halves the state.
    assert ", 0.50x state |" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_emulated_fp8_trains_with_a_falling_loss_and_is_never_timed(
    run_cfg, tmp_path, recipe
) -> None:
    cfg = run_cfg(
        f"precision.options.recipe={recipe}",
        "model=mlp",
        "model.hidden_dim=64",
        "model.depth=3",
        "dataset.image_size=8",
        "optimizer=adamw",
        "precision=fp8",
        "precision.emulate=true",
        "trainer.max_steps=30",
        "trainer.log_every=10",
        "trainer.eval_every=20",
    )
    summary = train(cfg, tmp_path)
    losses = [r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert losses[-1] < losses[0] - 0.1
    # The MLP's head, "7", is kept for its shape; the first linear is no special case.
    assert summary["precision_details"] == {
        "emulated": True,
        "converted_linears": ["1", "3", "5"],
        "skipped_linears": {"7": "64x10 not multiples of 16"},
    }
    assert summary["samples_per_s"] is None and summary["step_time_ms"] is None
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert all(r["samples_per_s"] is None for r in rows if r["kind"] == "train")
    assert summary["checks"]["master_weights_fp32"]["passed"] is True
    # Evaluation runs the float8 linears too (under no_grad: they fail under inference_mode).
    assert summary["eval_acc"] is not None
