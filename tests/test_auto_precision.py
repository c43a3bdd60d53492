"""precision=auto times the run's own model, leaves no trace, caches its choice, and agrees
across ranks."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
from torch import nn

import amp_exp.training.auto_precision as auto_precision
from amp_exp.config.precisions import auto_candidates
from amp_exp.results.checkpoint import load_newest_valid
from amp_exp.run import build, train
from amp_exp.runtime.cache import cache_dir, read_entries
from amp_exp.runtime.probe import KernelTime
from amp_exp.tasks.base import DataBundle
from amp_exp.tasks.classification import ClassificationTask
from amp_exp.tasks.workload import Workload
from amp_exp.training.auto_precision import choose, resolve_precision, time_candidates
from amp_exp.training.capability import Capability
from helpers.probes import capability_with, inject_probe, timing_at
from helpers.runs import TINY

CPU = torch.device("cpu")
fp32, bf16, fp16 = "fp32", "bf16", "fp16"
# bf16 as fast as fp32 by the probe: worth a trial. fp16 50x slower: left out.
PLAUSIBLE_BF16 = {"fp32": 1.0, "bf16": 1.0, "fp16": 0.02}


@pytest.fixture
def own_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def with_times(monkeypatch, seconds: dict[str, float], spread: float = 0.1) -> list[list[str]]:
    """Run the real trial (and its side effects), but report ``seconds`` as its result, each
    low precision's passes spread ``spread`` in their ratio to fp32's."""
    real = auto_precision.time_candidates
    trials = []

    def timed(model, task, batch, candidates):
        real(model, task, batch, candidates)
        trials.append(list(candidates))
        spreads = {p: 0.0 if p == fp32 else spread for p in candidates}
        return {p: seconds[p] for p in candidates}, spreads

    monkeypatch.setattr(auto_precision, "time_candidates", timed)
    return trials


def small_workload() -> tuple[Workload, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 4))
    batch = (torch.randn(32, 8), torch.randint(4, (32,)))
    task = ClassificationTask(CPU, num_classes=4)
    return Workload(task, DataBundle([batch], []), model, False), batch


def test_the_trial_leaves_weights_gradients_buffers_mode_and_rng_untouched(
    run_cfg, own_cache
) -> None:
    workload, _ = small_workload()
    model = workload.model
    model.eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    resolved = choose(run_cfg(*TINY), capability_with(PLAUSIBLE_BF16), workload)
    assert resolved.precision in (fp32, bf16)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    assert not model.training
    assert torch.equal(torch.get_rng_state(), rng)


class Sleeps(torch.autograd.Function):
    """The identity, whose forward and backward each sleep as long as ``SLEEPS`` says for the
    autocast it runs under: a model whose cost in each precision is known."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.precision = bf16 if torch.is_autocast_enabled("cpu") else fp32
        time.sleep(SLEEPS[ctx.precision][0])
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(SLEEPS[ctx.precision][1])
        return grad


# (forward, backward) seconds: each backward outlasts its forward, bf16's pass fp32's.
SLEEPS = {fp32: (0.01, 0.03), bf16: (0.02, 0.07)}


class SleepyModel(nn.Module):
    """Two linears with ``Sleeps`` between them, so the backward pass goes through it."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(Sleeps.apply(self.first(x)))


def test_time_candidates_times_each_candidate_forward_and_backward() -> None:
    """Each candidate's time covers its forward and its backward, under its own autocast."""
    _, batch = small_workload()
    task = ClassificationTask(CPU, num_classes=4)
    seconds, spread = time_candidates(SleepyModel(), task, batch, [fp32, bf16])
    assert set(seconds) == {fp32, bf16} and spread["fp32"] == 0
    # Only lower bounds: a loaded machine may stretch any sleep. A time that left out the
    # backward, or ran bf16's pass without autocast, would fall short of these.
    assert seconds[fp32] >= sum(SLEEPS[fp32])
    assert seconds[bf16] >= sum(SLEEPS[bf16])


def test_auto_picks_the_fastest_and_quotes_the_measured_times(
    run_cfg, own_cache, monkeypatch
) -> None:
    trials = with_times(monkeypatch, {fp32: 0.0123, bf16: 0.0101})
    workload, _ = small_workload()
    resolved = choose(run_cfg(*TINY), capability_with(PLAUSIBLE_BF16), workload)
    assert trials == [[fp32, bf16]]
    assert resolved.precision == bf16
    assert resolved.reason == (
        "auto: bf16; this model's forward+backward (fastest of 3 passes, spread 10%): "
        "fp32 12.3 ms, "
        "bf16 10.1 ms; bf16 runs 1.22x fp32's speed; "
        "the probe measured fp16 about 50x slower than fp32"
    )


def test_a_low_precision_less_than_5_percent_faster_leaves_fp32(
    run_cfg, own_cache, monkeypatch
) -> None:
    with_times(monkeypatch, {fp32: 0.0100, bf16: 0.0097})
    workload, _ = small_workload()
    resolved = choose(run_cfg(*TINY), capability_with(PLAUSIBLE_BF16), workload)
    assert resolved.precision == fp32
    assert "no low precision is 5% faster than fp32 (bf16 1.03x fp32's speed)" in resolved.reason


def test_the_choice_is_cached_so_a_second_run_times_nothing(
    run_cfg, own_cache, monkeypatch
) -> None:
    trials = with_times(monkeypatch, {fp32: 0.02, bf16: 0.01})
    cfg, capability = run_cfg(*TINY), capability_with(PLAUSIBLE_BF16)
    first = choose(cfg, capability, small_workload()[0])
    again = choose(cfg, capability, small_workload()[0])
    assert len(trials) == 1
    assert first.precision == again.precision == bf16
    assert (
        "(fastest of 3 passes, spread 10%, cached from an earlier run): fp32 20 ms, bf16 10 ms"
        in again.reason
    )
    # Another model is another choice.
    choose(run_cfg(*TINY, "model.width=8"), capability, small_workload()[0])
    assert len(trials) == 2


def test_the_spread_is_how_far_the_figure_lies_from_its_typical_pass(monkeypatch) -> None:
    """The fastest passes (10 and 5 ms) say 2x fp32's speed; passes 2 and 3 ran bf16 beside
    fp32 at 1x: the figure lies 100% from its typical pass."""
    passes = {fp32: [[0.010], [0.010], [0.012]], bf16: [[0.005], [0.010], [0.012]]}
    monkeypatch.setattr(auto_precision, "interleave", lambda *args: passes)
    workload, batch = small_workload()
    seconds, spread = time_candidates(workload.model, workload.task, batch, [fp32, bf16])
    assert seconds == {fp32: 0.010, bf16: 0.005}
    assert spread == {"fp32": 0.0, "bf16": pytest.approx(1.0)}
    # One pass that a neighbour slowed (bf16's 30 ms) leaves the figure and the typical pass.
    passes = {fp32: [[0.010], [0.010], [0.012]], bf16: [[0.005], [0.030], [0.006]]}
    assert time_candidates(workload.model, workload.task, batch, [fp32, bf16])[1]["bf16"] == 0


def test_a_cached_choice_whose_passes_spread_wide_is_timed_again(
    run_cfg, own_cache, monkeypatch, caplog
) -> None:
    """A cached 5.14x fp32's speed chose bf16 where a fresh measurement said 2.07x."""
    trials = with_times(monkeypatch, {fp32: 0.02, bf16: 0.01}, spread=0.6)
    cfg, capability = run_cfg(*TINY), capability_with(PLAUSIBLE_BF16)
    first = choose(cfg, capability, small_workload()[0])
    assert "spread 60%" in first.reason
    with caplog.at_level(logging.INFO, logger="amp_exp"):
        again = choose(cfg, capability, small_workload()[0])
    assert len(trials) == 2 and "cached from an earlier run" not in again.reason
    assert "lie 60% from their typical pass, more than 25%; timing again" in caplog.text
    # Within 25%, the cached times stand.
    with_times(monkeypatch, {fp32: 0.02, bf16: 0.01}, spread=0.2)
    choose(run_cfg(*TINY, "model.width=8"), capability, small_workload()[0])
    assert (
        "cached from an earlier run"
        in choose(run_cfg(*TINY, "model.width=8"), capability, small_workload()[0]).reason
    )


@pytest.mark.parametrize("bf16_ms", [-5.5, 0, 1e-9, float("nan"), "10"])
def test_cached_times_that_cannot_be_measurements_are_timed_again(
    run_cfg, own_cache, monkeypatch, caplog, bf16_ms
) -> None:
    trials = with_times(monkeypatch, {fp32: 0.02, bf16: 0.025})
    cfg, capability = run_cfg(*TINY), capability_with(PLAUSIBLE_BF16)
    choose(cfg, capability, small_workload()[0])
    entries = read_entries(auto_precision.CACHE_FILE)
    [entry] = entries.values()
    entry["ms"]["bf16"] = bf16_ms
    (cache_dir() / auto_precision.CACHE_FILE).write_text(json.dumps(entries))
    with caplog.at_level(logging.WARNING):
        again = choose(cfg, capability, small_workload()[0])
    assert len(trials) == 2 and again.precision == fp32
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "holds times for this model that are no measurement (bf16 took " in warning
    assert "cached from an earlier run" not in again.reason


def test_where_the_probe_rules_every_low_precision_out_fp32_needs_no_trial(
    run_cfg, monkeypatch
) -> None:
    trials = with_times(monkeypatch, {})
    resolved = choose(
        run_cfg(*TINY), capability_with({"fp32": 1, "bf16": 0.1, "fp16": 0.02}), small_workload()[0]
    )
    assert trials == [] and resolved.precision == fp32
    assert resolved.reason == (
        "auto: fp32, nothing else to try (the probe measured bf16 about 10x and fp16 about 50x "
        "slower than fp32)"
    )


class OneOfTwoRanks:
    """Just the collective resolve_precision uses: rank 0 holds ``rank0_index``."""

    def __init__(self, is_main: bool, rank0_index: int) -> None:
        self.is_main, self.rank0_index = is_main, rank0_index

    def max(self, value: float) -> float:
        return max(value, self.rank0_index)


def test_under_torchrun_rank_0_decides_and_the_others_take_its_choice(
    run_cfg, own_cache, monkeypatch
) -> None:
    trials = with_times(monkeypatch, {fp32: 0.02, bf16: 0.01})
    cfg, capability = run_cfg(*TINY), capability_with(PLAUSIBLE_BF16)
    bf16_index = auto_candidates().index(bf16)
    other = resolve_precision(
        cfg, capability, small_workload()[0], OneOfTwoRanks(False, bf16_index)
    )
    assert trials == [] and other.precision == bf16
    main = resolve_precision(cfg, capability, small_workload()[0], OneOfTwoRanks(True, -1))
    assert trials == [[fp32, bf16]] and main.precision == bf16


def test_auto_trains_bit_identically_to_the_precision_it_chose_requested(
    run_cfg, tmp_path, own_cache, monkeypatch
) -> None:
    inject_probe(PLAUSIBLE_BF16)
    trials = with_times(monkeypatch, {fp32: 0.02, bf16: 0.01})
    # tiny_cnn has BatchNorm: a trial that left its statistics changed would show here.
    overrides = (*TINY, "trainer.max_steps=3", "trainer.eval_every=null")
    auto = train(run_cfg(*overrides), tmp_path / "auto")
    direct = train(run_cfg(*overrides, "precision=bf16"), tmp_path / "bf16")
    assert trials == [[fp32, bf16]]
    assert auto["precision"] == direct["precision"] == "bf16"
    assert "fp32 20 ms, bf16 10 ms" in auto["precision_reason"]
    assert auto["final_loss"] == direct["final_loss"]
    auto_state = load_newest_valid(tmp_path / "auto")[1]
    direct_state = load_newest_valid(tmp_path / "bf16")[1]
    for name, tensor in direct_state["model"].items():
        assert torch.equal(auto_state["model"][name], tensor), name
    assert torch.equal(auto_state["rng"][0]["torch"], direct_state["rng"][0]["torch"])


def test_a_bf16_the_run_timed_faster_gets_no_probe_warning_that_it_is_slower(
    run_cfg, own_cache, monkeypatch
) -> None:
    """The probe's kernels put bf16 1.19x slower than fp32, yet this model ran faster in bf16:
    auto picks bf16 on the model's own timing, and the probe's advice would contradict it (run.py
    logs the advice a build returns, once per sweep)."""
    inject_probe({"fp32": 1.0, "bf16": 0.84, "fp16": 0.02})
    with_times(monkeypatch, {fp32: 0.0257, bf16: 0.01})
    auto = build(run_cfg(*TINY))
    assert auto.resolved.precision == bf16 and "2.57x fp32's speed" in auto.resolved.reason
    assert auto.hardware["advice"] == []
    # Asked for by name, bf16 was never timed on this model: the probe's advice stands.
    requested = build(run_cfg(*TINY, "precision=bf16"))
    assert requested.hardware["advice"] == [
        "the probe's conv kernels ran bf16 about 1.19x slower than fp32 here: use precision=fp32"
    ]


def test_a_requested_variant_is_named_in_the_reason(run_cfg) -> None:
    workload, capability = small_workload()[0], capability_with(PLAUSIBLE_BF16)
    nearest = resolve_precision(run_cfg("precision=bf16_true_nearest"), capability, workload)
    assert nearest.reason == (
        "requested: precision=bf16_true_nearest (bf16_true, precision.stochastic_rounding=false)"
    )
    plain = resolve_precision(run_cfg("precision=bf16_true"), capability, workload)
    assert plain.reason == "requested: precision=bf16_true"


def test_a_resumed_auto_run_keeps_its_precision_whatever_the_timings_say_now(
    run_cfg, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    inject_probe(PLAUSIBLE_BF16)
    with_times(monkeypatch, {fp32: 0.02, bf16: 0.01})
    overrides = (*TINY, "trainer.eval_every=null", "checkpoint.every_steps=2")
    first = train(run_cfg(*overrides, "trainer.max_steps=2"), tmp_path / "run")
    assert first["precision"] == "bf16"
    # Another timing cache, in which fp32 is the faster: a fresh decision would train fp32.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "other_cache"))
    inject_probe(PLAUSIBLE_BF16)
    trials = with_times(monkeypatch, {fp32: 0.001, bf16: 0.01})
    assert choose(run_cfg(*TINY), capability_with(PLAUSIBLE_BF16), small_workload()[0]).precision
    assert trials.pop() == [fp32, bf16]

    resumed = train(run_cfg(*overrides, "trainer.max_steps=4", "resume=auto"), tmp_path / "run")
    assert trials == []
    assert (resumed["status"], resumed["steps"], resumed["precision"]) == ("completed", 4, "bf16")
    assert resumed["precision_reason"] == (
        "auto: bf16, kept from the checkpoint at step 2 (as precision=auto chose it)"
    )
    assert [a["precision"] for a in resumed["attempts"]] == ["bf16", "bf16"]


def test_auto_rules_out_by_the_probes_kernels_of_the_models_kind(
    run_cfg, own_cache, monkeypatch
) -> None:
    """bf16's convolution 10x slower puts the three kernels' geometric mean at 0.46x fp32's
    speed, past the 2x that rules a precision out; this model has only linears, whose matmul
    runs as fast in bf16, so bf16 is timed on it."""
    slow_conv = {**timing_at(1.0), "conv": KernelTime(ms=10.0, tflops=0.1)}
    capability = Capability(
        "cpu", "test cpu", {}, {fp32: timing_at(1.0), bf16: slow_conv}, key="test cpu"
    )
    assert capability.trial_candidates() == [fp32]  # all kernels: ruled out
    trials = with_times(monkeypatch, {fp32: 0.02, bf16: 0.01})
    assert choose(run_cfg(*TINY), capability, small_workload()[0]).precision == bf16
    assert trials == [[fp32, bf16]]
