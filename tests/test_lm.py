"""Language models: the GPT, its FLOPs, token data, tokens/s, MFU and perplexity, end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from amp_exp.config.models import GPTConfig
from amp_exp.config.preflight import check_overrides
from amp_exp.config.values import validate
from amp_exp.errors import ConfigError
from amp_exp.report.assemble import build_report
from amp_exp.results.dashboard import wandb_metrics
from amp_exp.run import train
from amp_exp.tasks.flops import matmul_parameters
from amp_exp.tasks.gpt import GPT, flops_per_token
from amp_exp.tasks.lm import LanguageModelTask
from amp_exp.tasks.sampling import Placement
from amp_exp.tasks.tokens import (
    build_synthetic_tokens,
    markov_chain,
    sample_chain,
)
from amp_exp.tasks.workload import build_data
from amp_exp.training.flops import peak_tflops
from amp_exp.training.meters import Meter
from helpers.runs import FAST_LM, read_jsonl, signal_self_at_call
from helpers.wandb_records import read_only_run
from test_checkpoint import assert_same_state, without_timing

CPU = torch.device("cpu")
LM_SUMMARY_KEYS = {
    "tokens_per_s",
    "flops_per_token",
    "tflops",
    "mfu",
    "mfu_peak_source",
    "eval_perplexity",
    "loss_floor",
}


@pytest.fixture
def lm_cfg(compose_cfg):
    def _lm_cfg(*overrides: str):
        return validate(compose_cfg(*FAST_LM, *overrides, fast=False))

    return _lm_cfg


def tiny_gpt(**fields) -> GPT:
    cfg = GPTConfig(**{"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16, **fields})
    return GPT(cfg, vocab_size=64)


# --- the model -------------------------------------------------------------------------------


def test_gpt_is_causal_and_scores_tokens_with_its_embedding() -> None:
    torch.manual_seed(0)
    model = tiny_gpt().eval()
    tokens = torch.randint(64, (2, 16))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 64
    logits, logits_changed = model(tokens), model(changed)
    assert logits.shape == (2, 16, 64)
    assert torch.allclose(logits[:, :10], logits_changed[:, :10])  # the past ignores the future
    assert not torch.allclose(logits[:, 10:], logits_changed[:, 10:])
    assert model.lm_head.weight is model.wte.weight
    counted = sum(p.numel() for p in model.parameters())
    assert matmul_parameters(model) == counted - model.wpe.weight.numel()


@pytest.mark.parametrize("bias", [True, False])
def test_flops_formula_is_within_10_percent_of_torchs_flop_counter(bias: bool) -> None:
    model = tiny_gpt(bias=bias)
    tokens = torch.randint(64, (4, 16))
    # The math backend decomposes attention into matmuls the counter sees (it has no formula
    # for the CPU's fused kernel); forward and backward are both counted.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    measured = counter.get_total_flops() / tokens.numel()
    assert measured == pytest.approx(flops_per_token(model, 16), rel=0.10)


# --- peaks and MFU ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "precision", "tf32", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", True, 989),
        ("NVIDIA H100 PCIe", "fp16", True, 756),
        ("NVIDIA H100 NVL", "bf16", True, 835),
        ("NVIDIA H200", "bf16", True, 989),
        # Pure bf16 runs bf16 matmuls: the same peak (it once had no entry, so mfu was null).
        ("NVIDIA H200", "bf16_true", True, 989),
        # fp8 runs read the fp8 peak (devices.py), twice bf16's: not bf16's 989.
        ("NVIDIA H200", "fp8", True, 1979),
        ("NVIDIA A100-SXM4-80GB", "fp32", True, 156),
        ("NVIDIA A100-SXM4-80GB", "fp32", False, 19.5),
        ("NVIDIA A10G", "bf16", True, 70),
        ("NVIDIA L4", "bf16", True, 121),
        ("NVIDIA GeForce RTX 4090", "fp16", True, 165.2),
        ("NVIDIA B200", "bf16", True, 2250),
        ("Tesla V100-SXM2-16GB", "fp16", True, 125),
        ("Tesla V100-PCIE-32GB", "fp16", True, 112),
        ("Tesla V100-SXM2-16GB", "fp32", True, 15.7),  # no TF32 before Ampere
        ("Tesla V100-SXM2-16GB", "bf16", True, None),
        ("NVIDIA L40S", "bf16", True, None),  # not an L4
        ("NVIDIA GH200 480GB", "bf16", True, None),  # not an H200
        ("AMD EPYC", "fp32", True, None),
    ],
)
def test_peak_comes_from_the_table_for_the_device_and_math(name, precision, tf32, peak) -> None:
    found, source = peak_tflops(name, precision, tf32)
    assert found == peak
    assert (source is None) == (peak is None)
    if source:
        assert f"{peak:g} TFLOP/s" in source


def test_the_meter_turns_samples_per_second_into_tokens_tflops_and_mfu() -> None:
    # 100 sequences of 500 tokens a second, at 1 GFLOP a token, on a 100 TFLOP/s device.
    meter = Meter("tokens", 500, 1, 1e9, 100.0, "x")
    assert meter.rates(100.0) == {
        "samples_per_s": 100.0,
        "tokens_per_s": 50_000.0,
        "tokens_per_s_per_device": 50_000.0,
        "tflops": 50.0,
        "mfu": 0.5,
        "mfu_measured": None,
    }
    # Against the probe's measured peak too, where one was measured (CUDA).
    measured = Meter("tokens", 500, 1, 1e9, 100.0, "x", 80.0)
    assert measured.rates(100.0)["mfu_measured"] == 50.0 / 80.0
    assert Meter("tokens", 500, 1, 1e9).rates(100.0)["mfu"] is None
    assert Meter("tokens", 500).rates(100.0)["tflops"] is None
    assert Meter("tokens", 500, 1, 1e9, 100.0).summary(None)["tokens_per_s"] is None
    # A task that counts samples gets samples/s alone.
    assert Meter().summary(100.0) == {"samples_per_s": 100.0}


def test_tflops_and_mfu_are_per_device_and_tokens_per_second_global() -> None:
    """The same global tokens/s on 4 devices is a quarter of the work per device."""
    one, four = (Meter("tokens", 500, ranks, 1e9, 100.0, "x", 80.0) for ranks in (1, 4))
    alone, spread = one.rates(100.0), four.rates(100.0)
    assert spread["tokens_per_s"] == alone["tokens_per_s"] == 50_000.0
    assert spread["tokens_per_s_per_device"] == 12_500.0
    for key in ("tflops", "mfu", "mfu_measured"):
        assert spread[key] == pytest.approx(alone[key] / 4)


# --- synthetic tokens ------------------------------------------------------------------------


def test_synthetic_tokens_are_seeded_and_each_epochs_order_depends_on_seed_and_epoch(
    lm_cfg,
) -> None:
    cfg = lm_cfg()
    a, b = build_data(cfg, Placement(cfg.seed, CPU)), build_data(cfg, Placement(cfg.seed, CPU))
    first = next(iter(a.train))
    assert torch.equal(first[0], next(iter(b.train))[0])
    assert torch.equal(first[0][:, 1:], first[1][:, :-1])  # targets are the inputs, shifted
    assert first[0].shape == (8, 16) and a.facts == {"vocab_size": 32, "seq_len": 16}
    a.train.set_epoch(1)
    assert not torch.equal(first[0], next(iter(a.train))[0])
    b.train.set_epoch(1)
    assert torch.equal(next(iter(a.train))[0], next(iter(b.train))[0])
    cfg.seed = 1
    assert not torch.equal(first[0], next(iter(build_data(cfg, Placement(cfg.seed, CPU)).train))[0])


def test_loss_floor_is_the_true_chains_cross_entropy_on_its_samples(lm_cfg) -> None:
    cfg = lm_cfg("dataset.eval_size=2048")
    data = build_synthetic_tokens(cfg.dataset, 16, Placement(0, CPU))
    successors, probs = markov_chain(32, 4, seed=0)
    table = torch.zeros(32, 32, dtype=torch.float64)
    table.scatter_add_(1, successors, probs)  # duplicate successors add up
    losses = [-table[inputs.long(), targets.long()].log().mean() for inputs, targets in data.eval]
    empirical = float(torch.stack(losses).mean())
    floor = data.recorded["loss_floor"]
    assert empirical == pytest.approx(floor, rel=0.03)
    assert floor < 0.5 * math.log(32)


def test_chain_samples_follow_only_allowed_transitions() -> None:
    successors, probs = markov_chain(50, 3, seed=4)
    tokens = sample_chain(successors, probs, count=32, length=20, seed=5).long()
    allowed = (successors[tokens[:, :-1]] == tokens[:, 1:, None]).any(dim=2)
    assert bool(allowed.all())


# --- training ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_default_gpt_tiny_learns_synthetic_tokens_far_below_ln_vocab(compose_cfg, tmp_path) -> None:
    cfg = validate(
        compose_cfg("model=gpt_tiny", "dataset=synthetic_tokens", "wandb.mode=disabled", fast=False)
    )
    summary = train(cfg, tmp_path)
    vocab = cfg.dataset.vocab_size
    assert summary["task"] == "lm" and summary["steps"] == 300
    assert summary["loss_floor"] < summary["eval_loss"] < 0.5 * math.log(vocab)
    assert summary["eval_perplexity"] == pytest.approx(math.exp(summary["eval_loss"]))
    assert summary["tokens_per_s"] == pytest.approx(summary["samples_per_s"] * 32)
    assert summary["flops_per_token"] > 0
    assert summary["tflops"] == pytest.approx(
        summary["flops_per_token"] * summary["tokens_per_s"] / 1e12
    )
    # A CPU has no entry in the peak table: no MFU, and no peak named.
    assert summary["mfu"] is None and summary["mfu_peak_source"] is None


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_each_precision_trains_and_reports_tokens_per_second(lm_cfg, tmp_path, precision) -> None:
    summary = train(lm_cfg(f"precision={precision}", "trainer.timing_warmup_steps=0"), tmp_path)
    assert summary["status"] == "completed" and summary["precision"] == precision
    assert summary.keys() >= LM_SUMMARY_KEYS
    assert summary["tokens_per_s"] == pytest.approx(summary["samples_per_s"] * 16)
    assert math.isfinite(summary["eval_loss"]) and "eval_acc" not in summary
    assert summary["loss_floor"] > 0
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    train_rows = [row for row in rows if row["kind"] == "train"]
    assert all({"tokens_per_s", "tflops", "mfu"} <= row.keys() for row in train_rows)
    assert train_rows[-1]["tflops"] > 0
    assert rows[-1]["kind"] == "eval" and rows[-1]["eval_perplexity"] > 1


# 64 sequences / batch 8 = 8 batches an epoch: 12 steps cross an epoch boundary.
EXACT = ["trainer.max_steps=12", "trainer.log_every=2", "trainer.eval_every=null"]


@pytest.mark.parametrize(
    "precision",
    [
        "precision=fp32",
        "precision=bf16",
        # A huge initial scale makes the first steps skip, so the scaler state really evolves.
        "precision=fp16 precision.init_scale=16777216 precision.growth_interval=3",
    ],
)
def test_stopped_and_resumed_lm_run_matches_uninterrupted_run(
    override_loss, lm_cfg, tmp_path, precision
) -> None:
    overrides = [*EXACT, *precision.split()]
    whole = train(lm_cfg(*overrides), tmp_path / "whole")
    override_loss(signal_self_at_call(5))
    first = train(lm_cfg(*overrides), tmp_path / "split")
    assert (first["status"], first["steps"]) == ("stopped", 5)
    second = train(lm_cfg(*overrides, "resume=auto"), tmp_path / "split")
    assert second["status"] == "completed" and second["steps"] == 12
    assert second["skipped_steps"] == whole["skipped_steps"]
    ends = [
        torch.load(tmp_path / run / "checkpoints" / "last.pt", weights_only=True)
        for run in ("whole", "split")
    ]
    for part in ("model", "optimizer", "scaler", "scheduler", "progress"):
        assert_same_state(ends[0][part], ends[1][part], part)
    rows = [without_token_rates(tmp_path / run / "metrics.jsonl") for run in ("whole", "split")]
    assert rows[0] == rows[1]


def without_token_rates(path: Path) -> list[dict]:
    rates = {"tokens_per_s", "tokens_per_s_per_device", "tflops", "mfu", "mfu_measured"}
    return [
        {k: v for k, v in row.items() if k not in rates} for row in without_timing(read_jsonl(path))
    ]


def test_lm_rows_reach_wandb_under_perf_and_eval_keys(lm_cfg, tmp_path) -> None:
    # The audit on the untimed first step: the first row's interval then has a timed step.
    summary = train(lm_cfg("wandb.mode=offline", "diagnostics.audit_step=1"), tmp_path)
    run = read_only_run(tmp_path)
    assert {"perf/tokens_per_s", "perf/tflops"} <= run.history[0].keys()
    assert run.history[-1]["eval/perplexity"] == pytest.approx(summary["eval_perplexity"])
    assert run.summary["eval/loss_floor"] == pytest.approx(summary["loss_floor"])
    # MFU is None on a CPU, and W&B leaves out what was not measured.
    assert "perf/mfu" not in run.history[0]
    assert wandb_metrics({"mfu": 0.3, "tflops": 2.0})["perf/mfu"] == 0.3


# --- bad pairings --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["model=gpt_tiny", "dataset=synthetic"],
            "model=gpt_tiny cannot train on dataset=synthetic (image data",
        ),
        (["model=resnet18", "dataset=synthetic_tokens"], "model=resnet18 cannot train on"),
        (["task=lm"], "task=lm does not fit dataset=synthetic"),
        (["model=gpt_tiny", "dataset=synthetic_tokens", "dataset.seq_len=64"], "exceeds model"),
        (
            ["model=gpt_tiny", "dataset=synthetic_tokens", "model.vocab_size=100"],
            "model.vocab_size=100 is smaller than the data's vocabulary (128)",
        ),
        (["model=gpt_tiny", "model.d_model=33"], "must be a multiple of model.n_head"),
        (["dataset=text", "model=gpt_tiny", "dataset.path=/no/such"], "no such file"),
    ],
)
def test_bad_pairing_is_one_line_before_anything_is_built(overrides, expected) -> None:
    with pytest.raises(ConfigError) as raised:
        check_overrides(overrides)
    message = str(raised.value)
    assert expected in message and "\n" not in message
    if "cannot train" in expected:
        assert "valid pairings: image models" in message


# --- report and CLI -------------------------------------------------------------------------


def write_lm_run(path: Path, precision: str, tokens_per_s: float, perplexity: float) -> None:
    path.mkdir(parents=True)
    summary = {
        "status": "completed",
        "model": "gpt_tiny",
        "precision": precision,
        "device_name": "NVIDIA H100 80GB HBM3",
        "samples_per_s": tokens_per_s / 32,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s / 1e6,
        "peak_mem_bytes": 2**30,
        "peak_mem_kind": "cuda_max_allocated",
        "final_loss": math.log(perplexity),
        "eval_loss": math.log(perplexity),
        "eval_perplexity": perplexity,
        "task_metrics": LanguageModelTask.metrics.as_dict(),
        "skipped_steps": 0,
        "config": {"model": {"name": "gpt_tiny"}, "precision": {"name": precision}, "seed": 0},
    }
    (path / "summary.json").write_text(json.dumps(summary))
    (path / "metrics.jsonl").write_text("")


@pytest.mark.usefixtures("pngs_not_rasterized")  # read for its words (conftest)
def test_sweep_report_shows_tokens_mfu_and_perplexity_for_lm_runs(tmp_path) -> None:
    write_lm_run(tmp_path / "0", "fp32", 100_000.0, 3.0)
    write_lm_run(tmp_path / "1", "bf16", 300_000.0, 3.03)
    report = build_report([tmp_path], tmp_path)
    # Judged on the eval loss relative to fp32's (ln 3.03 / ln 3 - 1), against the LM task's 1%.
    assert report["verdicts"][0] == (
        "gpt_tiny: bf16 against fp32 on a single seed: Δ loss +0.91%, tolerance ±1.00%; one "
        "seed measures no noise, so no verdict (sweep seed=0,1,2 for one); 3.00x fp32's speed "
        "(one seed's jobs timed one after another: no interval), 1.00x the CUDA peak of fp32"
    )
    markdown = (tmp_path / "report.md").read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| run"))
    # report.md shows a language model's throughput in tokens; runs.csv holds every field.
    assert "| eval_loss |" in header and "| 300,000 tokens/s |" in markdown
    import csv

    rows = list(csv.DictReader((tmp_path / "runs.csv").open()))
    bf16 = next(row for row in rows if row["precision"] == "bf16")
    assert (float(bf16["tokens_per_s"]), float(bf16["mfu"])) == (300_000.0, 0.3)
    assert float(bf16["eval.eval_perplexity"]) > 0


@pytest.mark.usefixtures("pngs_not_rasterized")  # read for its words (conftest)
def test_report_of_image_runs_has_no_lm_columns(tmp_path) -> None:
    from test_report import write_run

    write_run(tmp_path / "0", "tiny_cnn", "fp32", 1000.0, 0.8)
    build_report([tmp_path], tmp_path)
    markdown = (tmp_path / "report.md").read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| run"))
    assert "tokens/s" not in header and "MFU" not in header and "perplexity" not in header


@pytest.mark.slow
def test_cli_lm_run_logs_tokens_per_second_and_perplexity(tmp_path, amp_exp_here) -> None:
    """Through the entry point, in this process."""
    ok = amp_exp_here(*FAST_LM, "precision=bf16", f"hydra.run.dir={tmp_path / 'ok'}")
    assert ok.returncode == 0, ok.stderr[-3000:]
    # Hydra's console log goes to stdout.
    assert "tokens/s" in ok.stdout and "eval loss" in ok.stdout and "perplexity" in ok.stdout
    summary = json.loads((tmp_path / "ok" / "summary.json").read_text())
    assert summary.keys() >= LM_SUMMARY_KEYS
