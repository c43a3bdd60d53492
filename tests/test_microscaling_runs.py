"""precision=mxfp8, mxfp4 and nvfp4 in whole runs: emulated on the CPU, refused without
precision.emulate, counted by the audit in their own formats, resumed bit for bit with NVFP4's
random parts, and under FSDP2."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from amp_exp.config.values import validate
from amp_exp.errors import ConfigError
from amp_exp.run import train
from helpers.runs import FAST_LM, composed, read_jsonl
from test_checkpoint import MODES, assert_resume_is_exact

# The formats a converted linear's matmuls are counted in: forward, and the gradients'.
FORMATS = {"mxfp8": {"mxfp8_e4m3"}, "mxfp4": {"mxfp4"}, "nvfp4": {"nvfp4"}}
# gpt_tiny at its own width (64: two MX blocks), a few steps.
GPT = [
    "model=gpt_tiny",
    "dataset=synthetic_tokens",
    "dataset.train_size=64",
    "dataset.eval_size=16",
    "dataset.batch_size=8",
    "trainer.device=cpu",
    "trainer.max_steps=4",
    "trainer.log_every=2",
    "trainer.timing_warmup_steps=1",
    "wandb.mode=disabled",
]


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> Callable[[str], dict]:
    """``emulated(precision)``: the summary of gpt_tiny's run in that format, emulated, trained
    once for this module's tests of it."""
    summaries: dict[str, dict] = {}
    run_dirs: dict[str, Path] = {}

    def summary(precision: str) -> dict:
        if precision not in summaries:
            overrides = (*GPT, f"precision={precision}", "precision.emulate=true")
            cfg = validate(copy.deepcopy(composed(overrides)))
            run_dirs[precision] = tmp_path_factory.mktemp(precision)
            summaries[precision] = train(cfg, run_dirs[precision])
        return summaries[precision]

    summary.run_dirs = run_dirs  # type: ignore[attr-defined]
    return summary


def test_a_block_scaled_run_logs_its_blocks_spread_against_the_scale_range(emulated) -> None:
    """NVFP4's signals rows carry its scale range (448 / 2^-9) and, per block, how far apart its
    16-element blocks' maxima are: at least 1 (the largest over the least), finite."""
    emulated("nvfp4")
    rows = read_jsonl(emulated.run_dirs["nvfp4"] / "metrics.jsonl")
    signals = [row for row in rows if row["kind"] == "signals"]
    assert signals and all(row["scale_range"] == 448 * 2**9 for row in signals)
    spreads = [v for row in signals for k, v in row.items() if k.startswith("act_block_spread/")]
    assert len(spreads) == 2 * len(signals) and all(1 <= v < math.inf for v in spreads)


@pytest.mark.parametrize("precision", sorted(FORMATS))
def test_each_format_trains_emulated_and_the_audit_counts_its_matmuls(precision, emulated):
    summary = emulated(precision)
    audit = summary["precision_audit"]
    assert audit["engaged"] is True, audit["shortfalls"]
    details = summary["precision_details"]
    assert details["emulated"] is True and summary["samples_per_s"] is None
    converted = details["converted_linears"]
    # Every block's four linears; the tied lm_head stays in bf16 (fp8's filter).
    assert len(converted) == 8 and "lm_head" in details["skipped_linears"]
    for name in converted:
        assert FORMATS[precision] <= set(audit["modules"][name]), name
    assert set(audit["modules"]["lm_head"]) == {"bfloat16"}
    assert FORMATS[precision] <= set(audit["forward"]["flops_by_dtype"])


@pytest.mark.parametrize("precision", sorted(FORMATS))
def test_without_emulate_on_the_cpu_a_format_is_refused_in_one_line(
    precision, tmp_path, monkeypatch, amp_exp_here
):
    """Through the command's entry point, in this process: the pre-flight refuses it."""
    monkeypatch.chdir(tmp_path)
    result = amp_exp_here(*GPT, f"precision={precision}")
    assert result.returncode == 2
    output = result.stdout + result.stderr
    assert "Traceback" not in output
    (line,) = [line for line in output.splitlines() if "error" in line.lower()]
    assert f"precision={precision} cannot run for real here" in line
    assert "add precision.emulate=true" in line
    assert list(tmp_path.iterdir()) == []


def test_mxfp4_and_nvfp4_need_emulate_even_on_a_gpu(run_cfg) -> None:
    """torchao has no MXFP4 or NVFP4 training kernels: the config is refused before torch loads,
    whatever the device."""
    for precision in ("mxfp4", "nvfp4"):
        with pytest.raises(ConfigError, match="no MXFP4 or NVFP4 training kernels"):
            run_cfg(f"precision={precision}", "trainer.device=auto")
    run_cfg("precision=mxfp8", "trainer.device=auto")


def test_an_option_of_another_format_is_refused(run_cfg) -> None:
    with pytest.raises(ConfigError, match="hadamard_wgrad is not an option of precision=mxfp8"):
        run_cfg(
            "precision=mxfp8", "precision.emulate=true", "+precision.options.hadamard_wgrad=true"
        )


def test_sensitivity_judges_each_module_against_the_formats_own_rounding(compose_cfg, tmp_path):
    from amp_exp.sensitivity.command import run_sensitivity

    overrides = [*FAST_LM, "precision=nvfp4", "precision.emulate=true", "sensitivity.batches=1"]
    cfg = validate(compose_cfg(*overrides, "sensitivity.precisions=[nvfp4]", fast=False))
    report = run_sensitivity(cfg, tmp_path)
    assert report["rankings"]["nvfp4"]
    # NVFP4's blocks lose about 20 dB; bf16's rounding, about 50 (a floor in bf16 would pass
    # every module that NVFP4 breaks).
    floors = [module["nvfp4"]["output_floor_db"] for module in report["modules"]]
    assert all(5 < floor < 25 for floor in floors), floors


def test_the_report_labels_a_variant_by_the_options_it_changed() -> None:
    from amp_exp.report.compare import variant_label

    def label(precision: str, **knobs) -> str:
        return variant_label({"precision": precision, "config": {"precision": knobs}})

    assert label("nvfp4", emulate=True) == "nvfp4 (emulated)"
    off = {"hadamard_wgrad": False, "weight_tiles": True}
    assert label("nvfp4", emulate=True, options=off) == "nvfp4 (hadamard_wgrad=false, emulated)"
    assert label("mxfp8", options={"scale_mode": "floor"}) == "mxfp8 (scale_mode=floor)"


def test_nvfp4_keeps_the_last_blocks_linears_in_bf16(compose_cfg, tmp_path) -> None:
    overrides = [*GPT, "precision=nvfp4", "precision.emulate=true"]
    cfg = validate(compose_cfg(*overrides, "precision.options.bf16_last_blocks=1", fast=False))
    summary = train(cfg, tmp_path)
    details = summary["precision_details"]
    assert all(name.startswith("blocks.0.") for name in details["converted_linears"])
    assert details["skipped_linears"]["blocks.1.mlp.fc"] == "in one of the last 1 blocks"
    modules = summary["precision_audit"]["modules"]
    assert set(modules["blocks.1.mlp.fc"]) == {"bfloat16"}
    assert "nvfp4" in modules["blocks.0.mlp.fc"]


def test_a_resumed_nvfp4_run_with_stochastic_rounding_and_hadamard_ends_bit_for_bit(
    run_cfg, override_loss, tmp_path
) -> None:
    """Both draw from the device's generator, which the checkpoint saves: a resume that drew
    other signs or other roundings would end elsewhere."""
    nvfp4 = ["precision=nvfp4", "precision.emulate=true", "optimizer=adamw"]
    assert_resume_is_exact(run_cfg, override_loss, tmp_path, [*MODES, *nvfp4])
    # They are on by default, and they matter: rounded to nearest, unrotated, it ends elsewhere.
    nearest = [
        "precision.options.stochastic_gradients=false",
        "precision.options.hadamard_wgrad=false",
    ]
    train(run_cfg(*MODES, *nvfp4, *nearest), tmp_path / "nearest")
    ends = [
        torch.load(tmp_path / run / "checkpoints" / "last.pt", weights_only=True)["model"]
        for run in ("whole", "nearest")
    ]
    assert any(not torch.equal(ends[0][key], ends[1][key]) for key in ends[0])


def test_fsdp2_quantizes_the_gathered_weight(compose_cfg, emulated, tmp_path) -> None:
    """Under FSDP2 (a group of one) each converted linear quantizes the weight its all-gather
    brings in: the run engages as one process does, and ends where it does."""
    overrides = [*GPT, "precision=mxfp8", "precision.emulate=true"]
    alone = emulated("mxfp8")
    sharded = train(
        validate(compose_cfg(*overrides, "trainer.strategy=fsdp2", fast=False)), tmp_path / "fsdp"
    )
    assert sharded["precision_audit"]["engaged"] is True
    assert sharded["precision_audit"]["modules"] == alone["precision_audit"]["modules"]
    assert sharded["final_loss"] == pytest.approx(alone["final_loss"], rel=1e-5)
