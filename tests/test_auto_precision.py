"""precision=auto times the run's own model by the speed trial's rounds, picks a lower precision
only where the trial's interval establishes it faster, leaves no trace, caches the trial, and agrees
across ranks."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
from torch import nn

import amp_exp.capability.auto as auto_precision
from amp_exp.capability.auto import choose, resolve_precision, time_candidates
from amp_exp.capability.cache import cache_dir, read_entries
from amp_exp.capability.device import Capability
from amp_exp.capability.probe import KernelTime
from amp_exp.capability.rounds import pass_trials
from amp_exp.config.precisions import auto_candidates
from amp_exp.results.checkpoint import load_newest_valid
from amp_exp.run import build, train
from amp_exp.tasks.base import DataBundle
from amp_exp.tasks.classification import ClassificationTask
from amp_exp.tasks.workload import Workload
from helpers.probes import capability_with, inject_probe, short_trials, timing_at
from helpers.runs import TINY
from test_diagnostics import trial_at

CPU = torch.device("cpu")
fp32, bf16, fp16 = "fp32", "bf16", "fp16"
# bf16 as fast as fp32 by the probe: worth a trial. fp16 50x slower: left out.
PLAUSIBLE_BF16 = {"fp32": 1.0, "bf16": 1.0, "fp16": 0.02}
# Trials whose interval lies wholly above 1, and one whose interval reaches below it.
FASTER = trial_at(2.0, 1.8, 2.2)
SLOWER = trial_at(0.5, 0.45, 0.55)


@pytest.fixture
def own_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def with_trial(monkeypatch, found: dict[str, dict]) -> list[list[str]]:
    """Run each candidate's real pass once (its autocast, its gradients, the no-trace guard), but
    report ``found`` (each low precision's speedup) as the trial's result."""
    trials = []

    def once(passes, device):
        for step in passes.values():
            step()
        return {p: found[p] for p in passes if p != fp32}

    def timed(model, task, batch, candidates, measure):
        trials.append(list(candidates))
        return time_candidates(model, task, batch, candidates, once)

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
    resolved = choose(run_cfg(*TINY), capability_with(PLAUSIBLE_BF16), workload, pass_trials)
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
    """Each candidate's pass covers its forward and its backward, under its own autocast."""
    _, batch = small_workload()
    task = ClassificationTask(CPU, num_classes=4)
    seconds = {}

    def measure(passes, device):
        for precision, step in passes.items():
            tick = time.perf_counter()
            step()
            seconds[precision] = time.perf_counter() - tick
        return {}

    assert time_candidates(SleepyModel(), task, batch, [fp32, bf16], measure) == {}
    # Only lower bounds: a loaded machine may stretch any sleep. A pass that left out the
    # backward, or ran bf16's pass without autocast, would fall short of these.
    assert seconds[fp32] >= sum(SLEEPS[fp32])
    assert seconds[bf16] >= sum(SLEEPS[bf16])


def test_auto_times_by_the_speed_trials_rounds_and_quotes_their_interval(
    run_cfg, own_cache, monkeypatch, caplog
) -> None:
    """Caught: auto timing by its own fastest pass instead of the speed trial's AB/BA rounds
    (capability/rounds.py's ``play``), or a reason without the trial's interval and its level."""
    played = short_trials(monkeypatch)
    with caplog.at_level("INFO", logger="amp_exp"):
        resolved = choose(
            run_cfg(*TINY), capability_with(PLAUSIBLE_BF16), small_workload()[0], pass_trials
        )
    assert played == [bf16]
    assert "(97.5% CI, 4 AB/BA rounds), total time" in resolved.reason
    assert resolved.reason.startswith(f"auto: {resolved.precision} by the speed trial")
    rounds = [r.message for r in caplog.records if r.message.startswith("speed bf16 vs fp32")]
    assert len(rounds) == 4


def test_auto_picks_a_precision_its_trial_establishes_faster_and_quotes_the_figure(
    run_cfg, own_cache, monkeypatch
) -> None:
    trials = with_trial(monkeypatch, {bf16: trial_at(1.22, 1.10, 1.35)})
    resolved = choose(
        run_cfg(*TINY), capability_with(PLAUSIBLE_BF16), small_workload()[0], pass_trials
    )
    assert trials == [[fp32, bf16]]
    assert resolved.precision == bf16
    assert resolved.reason == (
        "auto: bf16 by the speed trial on this model's forward+backward: "
        "bf16 1.22x [1.10x, 1.35x] (97.5% CI, 10 AB/BA rounds), total time 1.22x; "
        "bf16 runs 1.22x [1.10, 1.35] fp32's speed, its interval above 1; "
        "the probe measured fp16 about 50x slower than fp32"
    )


@pytest.mark.parametrize(
    "found",
    [
        # A faster median whose interval reaches below 1: not established.
        trial_at(1.30, 0.98, 1.70),
        # An interval above 1 from rounds that trend: the machine drifted under it.
        trial_at(2.0, 1.8, 2.2, trend=True),
        {"not_measured": "every round gave the same ratio: the clock measured no spread"},
    ],
    ids=["interval-reaches-below-1", "trend", "not-measured"],
)
def test_auto_keeps_fp32_unless_the_trials_interval_lies_above_1(
    run_cfg, own_cache, monkeypatch, found
) -> None:
    """Caught: auto picking a lower precision by its median (1.30x here) or by an interval the
    trial's rule does not accept (report/decision.py's ``established``)."""
    with_trial(monkeypatch, {bf16: found})
    resolved = choose(
        run_cfg(*TINY), capability_with(PLAUSIBLE_BF16), small_workload()[0], pass_trials
    )
    assert resolved.precision == fp32
    assert "no lower precision's interval lies above fp32's speed" in resolved.reason


def test_the_trial_is_cached_so_a_second_run_times_nothing(run_cfg, own_cache, monkeypatch) -> None:
    trials = with_trial(monkeypatch, {bf16: FASTER})
    cfg, capability = run_cfg(*TINY), capability_with(PLAUSIBLE_BF16)
    first = choose(cfg, capability, small_workload()[0], pass_trials)
    again = choose(cfg, capability, small_workload()[0], pass_trials)
    assert len(trials) == 1
    assert first.precision == again.precision == bf16
    assert again.reason.startswith(
        "auto: bf16 by the speed trial on this model's forward+backward, cached from an earlier "
        "run: bf16 2.00x [1.80x, 2.20x]"
    )
    # Another model is another trial.
    choose(run_cfg(*TINY, "model.width=8"), capability, small_workload()[0], pass_trials)
    assert len(trials) == 2


@pytest.mark.parametrize(
    "field, value",
    [("ratio", -5.5), ("ratio", float("nan")), ("ratio", "10"), ("ci", [3.0, 1.0]), ("trend", 1)],
)
def test_cached_speedups_that_cannot_be_the_trials_are_timed_again(
    run_cfg, own_cache, monkeypatch, caplog, field, value
) -> None:
    trials = with_trial(monkeypatch, {bf16: SLOWER})
    cfg, capability = run_cfg(*TINY), capability_with(PLAUSIBLE_BF16)
    choose(cfg, capability, small_workload()[0], pass_trials)
    entries = read_entries(auto_precision.CACHE_FILE)
    [entry] = entries.values()
    entry["bf16"][field] = value
    (cache_dir() / auto_precision.CACHE_FILE).write_text(json.dumps(entries))
    with caplog.at_level(logging.WARNING):
        again = choose(cfg, capability, small_workload()[0], pass_trials)
    assert len(trials) == 2 and again.precision == fp32
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "holds speedups for this model that are no measurement (bf16" in warning
    assert "cached from an earlier run" not in again.reason


def test_where_the_probe_rules_every_low_precision_out_fp32_needs_no_trial(
    run_cfg, monkeypatch
) -> None:
    trials = with_trial(monkeypatch, {})
    resolved = choose(
        run_cfg(*TINY),
        capability_with({"fp32": 1, "bf16": 0.1, "fp16": 0.02}),
        small_workload()[0],
        pass_trials,
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
    trials = with_trial(monkeypatch, {bf16: FASTER})
    cfg, capability = run_cfg(*TINY), capability_with(PLAUSIBLE_BF16)
    bf16_index = auto_candidates().index(bf16)
    other = resolve_precision(
        cfg, capability, small_workload()[0], pass_trials, OneOfTwoRanks(False, bf16_index)
    )
    assert trials == [] and other.precision == bf16
    main = resolve_precision(
        cfg, capability, small_workload()[0], pass_trials, OneOfTwoRanks(True, -1)
    )
    assert trials == [[fp32, bf16]] and main.precision == bf16


def test_auto_trains_bit_identically_to_the_precision_it_chose_requested(
    run_cfg, tmp_path, own_cache, monkeypatch
) -> None:
    inject_probe(PLAUSIBLE_BF16)
    trials = with_trial(monkeypatch, {bf16: FASTER})
    # tiny_cnn has BatchNorm: a trial that left its statistics changed would show here.
    overrides = (*TINY, "trainer.max_steps=3", "trainer.eval_every=null")
    auto = train(run_cfg(*overrides), tmp_path / "auto")
    direct = train(run_cfg(*overrides, "precision=bf16"), tmp_path / "bf16")
    assert trials == [[fp32, bf16]]
    assert auto["precision"] == direct["precision"] == "bf16"
    assert "bf16 2.00x [1.80x, 2.20x] (97.5% CI" in auto["precision_reason"]
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
    auto picks bf16 on the model's own trial, and the probe's advice would contradict it (run.py
    logs the advice a build returns, once per sweep)."""
    inject_probe({"fp32": 1.0, "bf16": 0.84, "fp16": 0.02})
    with_trial(monkeypatch, {bf16: trial_at(2.57, 2.3, 2.8)})
    auto = build(run_cfg(*TINY))
    assert auto.resolved.precision == bf16 and "2.57x [2.30, 2.80] fp32's speed" in (
        auto.resolved.reason
    )
    assert auto.hardware["advice"] == []
    # Asked for by name, bf16 was never timed on this model: the probe's advice stands.
    requested = build(run_cfg(*TINY, "precision=bf16"))
    assert requested.hardware["advice"] == [
        "the probe's conv kernels ran bf16 about 1.19x slower than fp32 here: use precision=fp32"
    ]


def test_a_requested_variant_is_named_in_the_reason(run_cfg) -> None:
    workload, capability = small_workload()[0], capability_with(PLAUSIBLE_BF16)
    nearest = resolve_precision(
        run_cfg("precision=bf16_true_nearest"), capability, workload, pass_trials
    )
    assert nearest.reason == (
        "requested: precision=bf16_true_nearest "
        "(bf16_true, precision.options.stochastic_rounding=false)"
    )
    plain = resolve_precision(run_cfg("precision=bf16_true"), capability, workload, pass_trials)
    assert plain.reason == "requested: precision=bf16_true"


def test_a_resumed_auto_run_keeps_its_precision_whatever_the_timings_say_now(
    run_cfg, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    inject_probe(PLAUSIBLE_BF16)
    with_trial(monkeypatch, {bf16: FASTER})
    overrides = (*TINY, "trainer.eval_every=null", "checkpoint.every_steps=2")
    first = train(run_cfg(*overrides, "trainer.max_steps=2"), tmp_path / "run")
    assert first["precision"] == "bf16"
    # Another timing cache, in which fp32 is the faster: a fresh decision would train fp32.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "other_cache"))
    inject_probe(PLAUSIBLE_BF16)
    trials = with_trial(monkeypatch, {bf16: SLOWER})
    fresh = choose(
        run_cfg(*TINY), capability_with(PLAUSIBLE_BF16), small_workload()[0], pass_trials
    )
    assert fresh.precision == fp32
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
    trials = with_trial(monkeypatch, {bf16: FASTER})
    assert choose(run_cfg(*TINY), capability, small_workload()[0], pass_trials).precision == bf16
    assert trials == [[fp32, bf16]]
