"""The long-run signals (training/signals.py): each figure equals the one computed by hand, the
hooks exist only on armed steps, and a run writes a signals row at every log step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import scipy.stats
import torch
import torch.nn.functional as F
from torch import nn

import ddp_jobs
from amp_exp.config.precisions import get
from amp_exp.config.values import validate
from amp_exp.run import build
from amp_exp.training.signals import Limits, SignalCollector, attention_logit_max
from helpers.runs import FAST_LM


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, time, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + y.transpose(1, 2).reshape(batch, time, width)


class Tiny(nn.Module):
    def __init__(self, width: int = 8, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Attention(width, heads) for _ in range(layers))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def fp16_collector(model: nn.Module) -> SignalCollector:
    return SignalCollector(Limits.of(get("fp16").spec)).attach(model)


def test_limits_come_from_the_precisions_formats() -> None:
    """fp16 reads 65504, fp8's converted linears e4m3's 448, bf16 its own range: a wrong
    format (the compute dtype for fp8) would make fp8's activations look 146x safer."""
    assert Limits.of(get("fp16").spec).format_max == 65504.0
    assert Limits.of(get("fp8").spec).format_max == 448.0
    assert Limits.of(get("bf16").spec).format_max == torch.finfo(torch.bfloat16).max
    # A key scored 0 gets weight exp(-limit): fp16's smallest subnormal, 2^-24.
    assert Limits.of(get("fp16").spec).attn_logit_limit == pytest.approx(24 * math.log(2))


def test_block_scaled_formats_bring_their_block_size_and_scale_range() -> None:
    """NVFP4's 16-element blocks with E4M3 scales under a tensor scale (448 / 2^-9 apart), MX's
    32-element blocks with E8M0 scales (2^254): an element format's range here (6 for E2M1)
    would put every run past its limit; fp16 has no blocks."""
    nvfp4, mxfp8, fp16 = (Limits.of(get(name).spec) for name in ("nvfp4", "mxfp8", "fp16"))
    assert (nvfp4.block_format, nvfp4.block_size, nvfp4.scale_range) == ("nvfp4", 16, 448 * 2**9)
    assert (mxfp8.block_size, mxfp8.scale_range) == (32, 2.0**254)
    assert (fp16.block_size, fp16.scale_range) == (None, None)


class Emits(nn.Module):
    """A block whose output is the given tensor (times a weight of 1, so it counts as a block)."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__()
        self.output, self.weight = output, nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output * self.weight


def test_the_block_spread_is_the_largest_block_maximum_over_the_least_nonzero_one() -> None:
    """NVFP4's blocks are 16 elements of a row: rows of 20 are padded to two blocks. Row 0's
    blocks peak at 8 and 0.002, row 1's at -1 and 0 (all zero: no scale to underflow, left
    out): 8 / 0.002 = 4,000. A spread over elements (8 / 0.0001) or over blocks that span rows
    would differ, and counting the zero block would give inf."""
    output = torch.zeros(2, 20)
    output[0, 3], output[0, 16], output[0, 17] = 8.0, 0.002, 0.0001
    output[1, 0] = -1.0
    model = nn.Sequential(Emits(output))
    collector = SignalCollector(Limits.of(get("nvfp4").spec)).attach(model)
    collector.arm()
    model(torch.zeros(1))
    row = collector.collect()
    assert row["act_block_spread/0"] == pytest.approx(4000.0)
    assert row["scale_range"] == 448 * 2**9 and "act_block_spread/0" not in (
        SignalCollector(Limits.of(get("fp16").spec)).attach(model).collect()
    )


def test_attention_logit_max_is_the_largest_unmasked_scaled_score() -> None:
    """Against the T x T scores built by hand; a causal mask leaves the future out (a missing
    mask would report a larger, never-used score)."""
    torch.manual_seed(0)
    q, k = torch.randn(3, 2, 6, 4), torch.randn(3, 2, 6, 4)
    k[:, :, -1] *= 50  # the last key scores highest, and only the last query may see it
    scores = q @ k.transpose(-2, -1) / 2.0
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    expected = scores.masked_fill(~causal, -math.inf).amax()
    assert attention_logit_max(q, k, is_causal=True).item() == pytest.approx(expected.item())
    assert attention_logit_max(q, k).item() == pytest.approx(scores.amax().item())


def test_the_update_ratio_holds_for_weights_not_contiguous_in_memory() -> None:
    """A channels_last convolution's weight (trainer.channels_last) is not contiguous: its flat
    view is a copy, which the optimizer's in-place step leaves behind. The update ratio must be
    the step's, computed by hand, not 0 from comparing the copy with itself."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3))
    model = model.to(memory_format=torch.channels_last)
    assert not model[0].weight.is_contiguous()
    collector = fp16_collector(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model[0].parameters()]
    collector.arm()
    model(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)).sum().backward()
    collector.before_update()
    optimizer.step()
    collector.after_update()
    row = collector.collect()
    update = torch.cat(
        [(p.detach() - b).flatten() for p, b in zip(model[0].parameters(), before, strict=True)]
    )
    weight = torch.cat([b.flatten() for b in before])
    expected = (update.norm() / weight.norm()).item()
    assert row["update_ratio/0"] == pytest.approx(expected, rel=1e-5)


def test_the_kept_causal_mask_fits_each_shape_it_is_asked_for() -> None:
    """The causal mask is kept between calls: a mask of another call's shape (a longer sequence
    first, then a shorter one, then keys longer than queries) would hide the wrong scores or
    fail to apply. Each against the scores built by hand."""
    torch.manual_seed(2)
    for rows, cols in ((9, 9), (5, 5), (4, 7), (9, 9)):
        q, k = torch.randn(2, 3, rows, 4), torch.randn(2, 3, cols, 4)
        k[..., -1, :] *= 50  # the last key scores highest; only a query that sees it may use it
        scores = q @ k.transpose(-2, -1) / 2.0
        hidden = torch.ones(rows, cols, dtype=torch.bool).triu(1)
        expected = scores.masked_fill(hidden, -math.inf).amax()
        assert attention_logit_max(q, k, is_causal=True).item() == pytest.approx(expected.item())


def test_the_scale_applies_to_the_largest_score_only_where_that_is_exact() -> None:
    """A positive scale multiplies the largest score, not every score: the same float32 value
    to the bit. A negative scale reverses the order, and a float mask adds to scaled scores,
    so there every score is scaled (the largest unscaled score times -1 would be the least)."""
    torch.manual_seed(3)
    q, k = torch.randn(2, 2, 6, 4), torch.randn(2, 2, 6, 4)
    scores = q @ k.transpose(-2, -1)
    assert attention_logit_max(q, k, scale=0.3).item() == (scores * 0.3).amax().item()
    assert attention_logit_max(q, k, scale=-0.3).item() == pytest.approx(
        (scores * -0.3).amax().item()
    )
    bias = torch.randn(6, 6)
    assert attention_logit_max(q, k, attn_mask=bias, scale=0.3).item() == pytest.approx(
        (scores * 0.3 + bias).amax().item()
    )


def test_log_steps_of_different_shapes_read_as_fresh_collectors_do() -> None:
    """The collector writes each output's sums into one scratch row and keeps its views for the
    step: a second log step with another batch shape (and two micro-batches) must read exactly
    as a fresh collector does, with nothing of the first step left in it."""
    torch.manual_seed(4)
    model = Tiny()
    reused = fp16_collector(model)
    steps = [[torch.randn(4, 6, 8)], [torch.randn(3, 5, 8), 5 * torch.randn(2, 5, 8)]]
    for inputs in steps:
        fresh = fp16_collector(model)
        rows = []
        for collector in (reused, fresh):
            collector.arm()
            for x in inputs:
                model(x)
            rows.append(collector.collect())
        assert rows[0] == rows[1]


def test_an_armed_step_measures_each_block_as_computed_by_hand() -> None:
    """Absmax, kurtosis (scipy's Pearson kurtosis), attention logits, output logits and the
    update ratio of one armed step, against the same figures computed from the tensors."""
    torch.manual_seed(0)
    model = Tiny()
    collector = fp16_collector(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 6, 8)
    outputs, scores = [], []
    with torch.no_grad():
        h = x
        for block in model.blocks:
            q, k, _ = block.qkv(h).split(8, dim=2)
            q, k = (t.view(4, 6, 2, 4).transpose(1, 2) for t in (q, k))
            scores.append(attention_logit_max(q, k, is_causal=True).item())
            h = block(h)
            outputs.append(h.flatten().double())
        logits = model.head(h)
    before = [p.detach().clone() for p in model.blocks[0].parameters()]

    collector.arm()
    model(x).sum().backward()
    collector.before_update()
    optimizer.step()
    collector.after_update()
    row = collector.collect()

    for index, output in enumerate(outputs):
        name = f"blocks.{index}"
        assert row[f"act_absmax/{name}"] == pytest.approx(output.abs().max().item())
        assert row[f"act_range_frac/{name}"] == pytest.approx(output.abs().max().item() / 65504)
        assert row[f"act_kurtosis/{name}"] == pytest.approx(
            scipy.stats.kurtosis(output.numpy(), fisher=False), rel=1e-6
        )
        assert row[f"attn_logit_max/{name}"] == pytest.approx(scores[index], rel=1e-5)
    assert row["logit_max"] == pytest.approx(logits.max().item(), rel=1e-6)
    assert row["logit_mean"] == pytest.approx(logits.mean().item(), rel=1e-6)
    after = list(model.blocks[0].parameters())
    update = math.sqrt(
        sum((a - b).square().sum().item() for a, b in zip(after, before, strict=True))
    )
    weight = math.sqrt(sum(b.square().sum().item() for b in before))
    assert row["update_ratio/blocks.0"] == pytest.approx(update / weight, rel=1e-6)
    assert row["format"] == "fp16" and row["format_max"] == 65504.0


def test_the_update_ratio_of_bf16_weights_is_exact_and_a_frozen_block_has_none() -> None:
    """bf16 weights (bf16_true): the update is the exact difference of the weights, as computed
    by hand in float64 (a copy kept in bf16 would round the updates of the weights that change by
    more than half, here 4e-4 of the ratio); a block without trainable weights reads None, not 0
    or a neighbour's ratio."""
    torch.manual_seed(0)
    model = Tiny(layers=3).to(torch.bfloat16)
    model.blocks[1].requires_grad_(False)
    collector = fp16_collector(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    before = [[p.detach().double() for p in block.parameters()] for block in model.blocks]

    collector.arm()
    model(torch.randn(4, 6, 8, dtype=torch.bfloat16)).sum().backward()
    collector.before_update()
    optimizer.step()
    collector.after_update()
    row = collector.collect()

    for index in (0, 2):
        after = [p.detach().double() for p in model.blocks[index].parameters()]
        pairs = list(zip(after, before[index], strict=True))
        update = math.sqrt(sum((a - b).square().sum().item() for a, b in pairs))
        weight = math.sqrt(sum(b.square().sum().item() for b in before[index]))
        assert row[f"update_ratio/blocks.{index}"] == pytest.approx(update / weight, rel=1e-9)
    assert row["update_ratio/blocks.1"] is None


def test_hooks_exist_only_between_arm_and_collect() -> None:
    """Unarmed steps run without a hook (and measure nothing); a hook left behind would cost
    every step."""
    model = Tiny()
    collector = fp16_collector(model)
    modules = [model, *model.blocks]
    collector.arm()
    assert all(m._forward_hooks for m in modules)
    model(torch.randn(2, 3, 8))
    collector.collect()
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in modules)
    model(torch.randn(2, 3, 8))
    collector.arm()
    row = collector.collect()
    assert row["act_absmax/blocks.0"] is None and row["logit_max"] is None


def test_micro_batches_of_one_step_are_pooled() -> None:
    """Two forwards of an armed step (gradient accumulation) count as one batch of both: the
    largest of both, the kurtosis of both together, not of the last."""
    torch.manual_seed(1)
    model = Tiny(layers=1)
    collector = fp16_collector(model)
    small, large = torch.randn(2, 4, 8), 30 * torch.randn(2, 4, 8)
    with torch.no_grad():
        both = torch.cat([model.blocks[0](small), model.blocks[0](large)]).flatten().double()
    collector.arm()
    model(small)
    model(large)
    row = collector.collect()
    assert row["act_absmax/blocks.0"] == pytest.approx(both.abs().max().item())
    assert row["act_kurtosis/blocks.0"] == pytest.approx(
        scipy.stats.kurtosis(both.numpy(), fisher=False), rel=1e-6
    )


def test_a_model_without_blocks_is_measured_by_its_children_with_weights() -> None:
    """A ResNet-like model: its stages, not its parameterless activations."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    collector = fp16_collector(model)
    assert [name for name, _ in collector.blocks] == ["0", "2"]


def lm_run(compose_cfg, *overrides: str):
    return build(validate(compose_cfg(*FAST_LM, *overrides, fast=False)))


def test_a_run_writes_a_signals_row_after_each_train_row(compose_cfg) -> None:
    """gpt_tiny: one signals row per log step, none between; each block measured."""
    built = lm_run(compose_cfg, "trainer.max_steps=4", "trainer.log_every=2")
    rows: list[dict] = []
    built.engine.fit(rows.append)
    signals = [row for row in rows if row["kind"] == "signals"]
    assert [row["step"] for row in signals] == [2, 4]
    for row in signals:
        for block in ("blocks.0", "blocks.1"):
            assert row[f"act_absmax/{block}"] > 0
            assert row[f"attn_logit_max/{block}"] is not None
            assert row[f"update_ratio/{block}"] > 0
        assert row["logit_max"] is not None


def test_signals_can_be_turned_off(compose_cfg) -> None:
    built = lm_run(compose_cfg, "diagnostics.signals=false")
    rows: list[dict] = []
    built.engine.fit(rows.append)
    assert not [row for row in rows if row["kind"] == "signals"]


# tests/signals_worker.py's two ranks, in the session's shared launch (tests/ddp_jobs.py).
POOLED = ddp_jobs.declare("signals_pooled", script=Path(__file__).with_name("signals_worker.py"))


@pytest.mark.slow
def test_two_ranks_report_the_signals_of_their_pooled_batches(shared_rank_jobs) -> None:
    """Over gloo, each rank's row holds the largest value and the kurtosis of both ranks' batches
    together: an unreduced rank 0 would report its own batch, ten times smaller."""
    for rank in (0, 1):
        result = shared_rank_jobs[1][POOLED][rank]
        for key, value in result["expected"].items():
            assert result["row"][key] == pytest.approx(value, rel=1e-6), (rank, key)
