"""The engine on real (tiny) runs: every precision, skipped steps, accumulation, learning."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F

from amp_exp.run import build, train
from helpers.runs import TINY, inf_loss_at, read_jsonl


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_few_steps_of_each_precision_complete(run_cfg, tmp_path, precision: str) -> None:
    summary = train(run_cfg(f"precision={precision}", *TINY), tmp_path)
    assert summary["precision"] == precision
    assert summary["steps"] == 4
    assert summary["skipped_steps"] == 0
    assert (summary["loss_scale"] is not None) == (precision == "fp16")
    assert summary["samples_per_s"] > 0
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [2, 4]
    # One evaluation, at the end, over the whole eval split: a count of its 64 images.
    (evaluation,) = [r for r in rows if r["kind"] == "eval"]
    assert evaluation["step"] == 4 and evaluation["eval_acc"] == summary["eval_acc"]
    correct = summary["eval_acc"] * 64
    assert correct == round(correct)
    assert all(r["grad_norm"] > 0 for r in train_rows)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


def test_forced_overflow_is_skipped_counted_and_holds_the_scheduler(override_loss, run_cfg) -> None:
    cfg = run_cfg("precision=fp16", "precision.init_scale=1024", "trainer.max_steps=3", *TINY)
    override_loss(inf_loss_at({1}))
    built = build(cfg)
    rows: list[dict] = []
    with warnings.catch_warnings():
        # The skipped first step is exactly when PyTorch would warn about scheduler order.
        warnings.simplefilter("error")
        result = built.engine.fit(rows.append)
    assert result.progress.skipped_steps == 1
    assert result.loss_scale == 512.0
    assert built.engine.scheduler.last_epoch == 2
    assert [r["skipped_steps"] for r in rows if "loss" in r] == [1, 1]


def test_fp16_rows_log_the_scale_and_its_geometric_mean_over_the_interval(
    override_loss, run_cfg
) -> None:
    """Step 1 overflows (1024 backs off to 512), then each finite step doubles the scale
    (growth_interval 1): steps 1 to 4 leave 512, 1024, 2048, 4096. The row at step 2 reads 1024
    and a mean of 2^9.5; the next interval starts anew (4096, 2^11.5): a record that kept the
    read, an arithmetic mean (768) or an unreset sum fails."""
    cfg = run_cfg(
        *TINY,
        "precision=fp16",
        "precision.init_scale=1024",
        "precision.growth_interval=1",
        "trainer.max_steps=4",
        "trainer.log_every=2",
    )
    override_loss(inf_loss_at({1}))
    rows: list[dict] = []
    build(cfg).engine.fit(rows.append)
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [(r["step"], r["scale"]) for r in train_rows] == [(2, 1024.0), (4, 4096.0)]
    assert [r["scale_mean"] for r in train_rows] == pytest.approx([2**9.5, 2**11.5])


def test_overflowed_step_leaves_the_parameters_alone(override_loss, run_cfg) -> None:
    cfg = run_cfg("precision=fp16", "trainer.max_steps=1", *TINY)
    override_loss(inf_loss_at({1}))
    built = build(cfg)
    before = {k: v.clone() for k, v in built.model.state_dict().items() if v.is_floating_point()}
    built.engine.fit(lambda row: None)
    after = built.model.state_dict()
    # BatchNorm running stats move in the forward pass; the trained parameters must not.
    for name, parameter in built.model.named_parameters():
        assert torch.equal(before[name], parameter), name
    assert any(not torch.equal(before[k], after[k]) for k in before if "running_mean" in k)


def test_accumulation_matches_one_big_batch(run_cfg) -> None:
    def params_after(batch_size: int, accum: int) -> list[torch.Tensor]:
        cfg = run_cfg(
            "model=mlp",
            "precision=fp32",
            "scheduler=none",
            "trainer.max_steps=2",
            f"dataset.batch_size={batch_size}",
            f"trainer.grad_accum_steps={accum}",
        )
        built = build(cfg)
        built.engine.fit(lambda row: None)
        return [p.detach().clone() for p in built.model.parameters()]

    for big, small in zip(params_after(32, 1), params_after(8, 4), strict=True):
        torch.testing.assert_close(big, small, rtol=1e-5, atol=1e-6)


def test_accumulation_unscales_once_per_optimizer_step(run_cfg) -> None:
    cfg = run_cfg("precision=fp16", "trainer.grad_accum_steps=2", "trainer.max_steps=2", *TINY)
    built = build(cfg)
    scaler = built.engine.precision.scaler
    unscales = []
    original = scaler.unscale_
    scaler.unscale_ = lambda optimizer: (unscales.append(1), original(optimizer))
    result = built.engine.fit(lambda row: None)
    assert len(unscales) == 2
    assert result.progress.samples == 2 * 2 * 16


def test_synthetic_data_is_learnable_and_bf16_tracks_fp32(run_cfg) -> None:
    def final(precision: str) -> dict:
        cfg = run_cfg(
            f"precision={precision}",
            "trainer.max_steps=80",
            "trainer.log_every=20",
            "dataset.noise_std=1.0",
            "dataset.image_size=8",
            "model.width=16",
        )
        progress = build(cfg).engine.fit(lambda row: None).progress
        return {"final_loss": progress.final_loss, **progress.eval}

    fp32, bf16 = final("fp32"), final("bf16")
    assert fp32["final_loss"] < 0.5 * 2.3026  # well below chance (ln 10)
    assert fp32["eval_acc"] > 0.6
    assert abs(bf16["final_loss"] - fp32["final_loss"]) < 0.15
    assert abs(bf16["eval_acc"] - fp32["eval_acc"]) < 0.1


def test_epochs_bound_the_run(run_cfg) -> None:
    cfg = run_cfg("trainer.max_steps=null", "trainer.epochs=2", *TINY)
    # 256 samples / batch 16 = 16 steps per epoch.
    assert build(cfg).engine.total_steps == 32


def test_eval_every_adds_eval_rows(run_cfg, tmp_path) -> None:
    train(run_cfg("trainer.eval_every=2", *TINY), tmp_path)
    eval_rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "eval_acc" in r]
    assert [r["step"] for r in eval_rows] == [2, 4]


def test_every_job_of_a_sweep_trains_on_the_same_batches(override_loss, run_cfg) -> None:
    """Jobs differ only in what the grid varies: same batches, same order, same initial weights."""

    def observe(*overrides: str):
        # 96 samples in batches of 32: 12 steps cross three epoch boundaries.
        cfg = run_cfg(
            "trainer.max_steps=12", "dataset.train_size=96", "dataset.image_size=8", *overrides
        )
        labels: list[torch.Tensor] = []

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            labels.append(target.clone())
            return F.cross_entropy(logits, target)

        override_loss(loss_fn)
        built = build(cfg)
        inputs: list[torch.Tensor] = []
        built.model.register_forward_pre_hook(lambda module, args: inputs.append(args[0].clone()))
        initial = {k: v.clone() for k, v in built.model.state_dict().items()}
        steps = built.engine.fit(lambda row: None).progress.step
        return labels, inputs, initial, steps

    fp32 = observe("precision=fp32", "model.width=4")
    fp16 = observe("precision=fp16", "model.width=4")
    mlp_bf16 = observe("precision=bf16", "model=mlp")
    for other in (fp16, mlp_bf16):
        assert len(other[0]) == len(fp32[0]) == 12
        assert all(torch.equal(a, b) for a, b in zip(fp32[0], other[0], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(fp32[1], other[1], strict=True))
        assert other[3] == fp32[3]
    assert fp32[2].keys() == fp16[2].keys()
    assert all(torch.equal(fp32[2][k], fp16[2][k]) for k in fp32[2])
    assert not torch.equal(fp32[0][0], fp32[0][3])  # a new epoch is a new order


def test_results_of_a_diverged_run_are_strict_json(override_loss, run_cfg, tmp_path) -> None:
    """Python writes bare NaN and Infinity, which strict JSON readers refuse; results use null."""
    override_loss(inf_loss_at({4}))
    summary = train(run_cfg("trainer.on_nonfinite=off", *TINY), tmp_path)
    assert summary["final_loss"] == float("inf")

    def refuse(constant: str) -> None:
        raise ValueError(f"non-standard JSON constant {constant}")

    written = json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse)
    assert written["final_loss"] is None
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=refuse)


def test_compiled_model_stays_one_graph_through_scaler_steps_and_skips(
    override_loss, run_cfg, tmp_path, monkeypatch
) -> None:
    """Only the model is compiled: the scaler's unscale/step/update and a skipped step with its
    scale back-off run outside the graph, so they neither break it nor make it recompile.
    (aot_eager captures forward and backward as inductor would, without its code generation.)"""
    import torch._dynamo
    from torch._dynamo.utils import counters

    real_compile = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda model, mode: real_compile(model, backend="aot_eager")
    )
    torch._dynamo.reset()
    counters.clear()
    cfg = run_cfg(
        "precision=fp16",
        "trainer.compile=true",
        "trainer.max_steps=6",
        "trainer.eval_every=null",
        *TINY,
    )
    override_loss(inf_loss_at({3}))
    summary = train(cfg, tmp_path)
    assert summary["skipped_steps"] == 1 and summary["loss_scale"] == 65536.0 / 2
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
