"""precision.keep_fp32: the modules it names compute in fp32 in every mode, under DDP and FSDP2,
and a pattern that matches no module is refused in one line."""

from __future__ import annotations

import pytest
import torch

import ddp_jobs
from amp_exp.build import build
from amp_exp.config.schema import DeviceChoice, Strategy
from amp_exp.config.values import validate
from amp_exp.errors import ConfigError
from amp_exp.run import train
from amp_exp.runtime.distributed import process_group
from amp_exp.runtime.fsdp import ShardingDtypes, shard_model
from amp_exp.tasks.gpt import GPT
from amp_exp.training.keep_fp32 import match_keep_fp32
from helpers.matmul_dtypes import linear_dtypes
from helpers.runs import FAST_LM, TINY_GPT

KEPT = ["blocks.0.mlp.fc", "blocks.0.mlp.proj"]
LOW = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "bf16_true": torch.bfloat16,
    "fp8": torch.bfloat16,
    "fp32": torch.float32,
}


def tiny_gpt() -> GPT:
    from amp_exp.config.schema import GPTConfig

    return GPT(GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8), vocab_size=32)


def test_globs_match_module_names_and_the_outermost_match_is_kept() -> None:
    model = tiny_gpt()
    assert match_keep_fp32(model, ["blocks.*.mlp"]) == ["blocks.0.mlp", "blocks.1.mlp"]
    assert match_keep_fp32(model, ["blocks.0.mlp.fc", "blocks.0*"]) == ["blocks.0"]
    assert match_keep_fp32(model, ["lm_head", "ln_?"]) == ["lm_head", "ln_f"]
    assert match_keep_fp32(model, []) == []


def test_a_pattern_that_matches_no_module_names_the_nearest_in_one_line() -> None:
    with pytest.raises(ConfigError) as refused:
        match_keep_fp32(tiny_gpt(), ["lm_head", "blocks.0.mpl"])
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("precision.keep_fp32: 'blocks.0.mpl' matches no module of the model")
    assert "nearest names: blocks.0.mlp" in message


def test_a_run_refuses_the_pattern_as_soon_as_its_model_is_built(compose_cfg, tmp_path) -> None:
    overrides = [*FAST_LM, "precision=fp32", "precision.keep_fp32=[lm_haed]"]
    cfg = validate(compose_cfg(*overrides, fast=False))
    with pytest.raises(ConfigError, match=r"'lm_haed' matches no module .* nearest names: lm_head"):
        train(cfg, tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_an_empty_pattern_is_refused_by_validation(compose_cfg) -> None:
    with pytest.raises(ConfigError, match=r"precision\.keep_fp32 holds an empty pattern"):
        validate(compose_cfg(*FAST_LM, "precision.keep_fp32=['']", fast=False))


@pytest.mark.parametrize("precision", list(LOW), ids=str)
def test_kept_modules_compute_in_fp32_in_every_mode(compose_cfg, precision) -> None:
    overrides = [*FAST_LM, f"precision={precision}", "precision.emulate=true"]
    overrides.append("precision.keep_fp32=[blocks.0.mlp]")
    built = build(validate(compose_cfg(*overrides, fast=False)))
    engine = built.engine
    with linear_dtypes(built.model) as seen:
        with engine.precision.forward_context():
            loss = engine.task.loss(engine.model, engine.task.to_device(next(iter(engine.data))))
        engine.precision.backward(loss)
    assert engine.precision.summary_fields()["keep_fp32_modules"] == ["blocks.0.mlp"]
    for name, (output, weight, kind) in seen.items():
        if name in KEPT:
            assert (output, weight, kind) == (torch.float32, torch.float32, "Linear"), name
        else:
            assert output == LOW[precision], name
    grads = {name: p.grad.dtype for name, p in built.model.named_parameters()}
    assert grads["blocks.0.mlp.fc.weight"] == torch.float32
    if precision == "fp8":
        assert engine.precision.conversion.skipped["blocks.0.mlp.fc"] == "precision.keep_fp32"
        assert seen["blocks.1.mlp.fc"][2] == "Float8Linear"


def test_fsdp2_shards_kept_modules_under_an_fp32_policy() -> None:
    with process_group(DeviceChoice.cpu, Strategy.fsdp2):
        dtypes = ShardingDtypes.for_precision("bf16", None, cast_params=True)
        gpt = tiny_gpt()
        model = shard_model(gpt, dtypes, torch.device("cpu"), gpt.blocks, ["blocks.0.mlp"])
        with linear_dtypes(model) as seen:
            model(torch.randint(32, (2, 8))).sum().backward()
        assert seen["blocks.0.mlp.fc"][:2] == (torch.float32, torch.float32)
        assert seen["blocks.0.attn.qkv"][:2] == (torch.bfloat16, torch.bfloat16)
        # Back in bf16 for the block's next layer, which computes in bf16.
        assert seen["blocks.1.attn.qkv"][0] == torch.bfloat16
        with pytest.raises(ConfigError, match=r"lm_head shares its parameter wte\.weight"):
            shard_model(tiny_gpt(), dtypes, torch.device("cpu"), keep_fp32=["lm_head"])


def test_an_fsdp2_run_trains_with_kept_modules(compose_cfg, tmp_path) -> None:
    overrides = [*FAST_LM, "trainer.strategy=fsdp2", "precision=bf16"]
    cfg = validate(compose_cfg(*overrides, "precision.keep_fp32=[blocks.*.mlp]", fast=False))
    summary = train(cfg, tmp_path)
    assert summary["status"] == "completed"
    assert summary["keep_fp32_modules"] == ["blocks.0.mlp", "blocks.1.mlp"]


# In the session's shared launch (tests/ddp_jobs.py).
DDP_KEPT = ddp_jobs.declare(
    "keep_fp32_ddp",
    "--linear-dtypes",
    "trainer.device=cpu",
    "trainer.max_steps=2",
    "wandb.mode=disabled",
    *TINY_GPT,
    "dataset=synthetic_tokens",
    "dataset.vocab_size=32",
    "dataset.train_size=64",
    "dataset.batch_size=8",
    "precision=bf16",
    "precision.keep_fp32=[blocks.0.mlp]",
)


@pytest.mark.slow
def test_ddp_ranks_compute_kept_modules_in_fp32(shared_rank_jobs) -> None:
    ranks = shared_rank_jobs[1][DDP_KEPT]
    for rank in (0, 1):
        seen = ranks[rank]["linear_dtypes"]
        assert seen["blocks.0.mlp.fc"] == "torch.float32"
        assert seen["blocks.1.mlp.fc"] == "torch.bfloat16"
        assert ranks[rank]["summary"]["keep_fp32_modules"] == ["blocks.0.mlp"]
        assert ranks[rank]["summary"]["world_size"] == 2
