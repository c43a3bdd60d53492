"""FSDP2 in one process: the policy, block sharding, activation checkpointing, sharded checkpoints
and resuming on another world size. Runs without torchrun, in a process group of one."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule

from amp_exp.config.preflight import check_overrides
from amp_exp.config.schema import CompileMode, DeviceChoice, ReduceDtype, Strategy
from amp_exp.config.values import validate
from amp_exp.errors import ConfigError
from amp_exp.launch import WorkerRank
from amp_exp.results.resume import data_position
from amp_exp.run import build, train
from amp_exp.runtime.distributed import process_group
from amp_exp.runtime.fsdp import ShardingDtypes, shard_model
from amp_exp.tasks.blocks import checkpoint_blocks, compile_blocks, model_blocks
from amp_exp.tasks.sampling import EpochShuffleSampler, Placement
from amp_exp.tasks.vision_models import TinyCNN
from helpers.runs import TINY, TINY_GPT, TINY_MLP

FSDP = [*TINY, "trainer.strategy=fsdp2"]


class Blocks(nn.Module):
    """A stand-in for a transformer: an embedding, blocks in ``model.blocks``, a head."""

    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                          nn.Linear(4 * width, width))
            for _ in range(depth)
        )  # fmt: skip
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def test_the_policy_follows_the_precision_and_reduce_dtype_overrides_it():
    # By default FSDP2 gathers the fp32 weights and autocast computes, as under DDP.
    autocast = ShardingDtypes.for_precision("bf16", None)
    assert (autocast.param, autocast.reduce, autocast.casts_params) == ("fp32", "fp32", False)
    assert autocast.policy().param_dtype is None
    bf16 = ShardingDtypes.for_precision("bf16", None, cast_params=True)
    assert (bf16.param, bf16.reduce) == ("bf16", "fp32")
    policy = bf16.policy()
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (
        torch.bfloat16,
        torch.float32,
        None,
    )
    # The root hands its output over in fp32, so the loss runs in fp32 as under autocast.
    assert bf16.policy(output_fp32=True).output_dtype == torch.float32
    fp16 = ShardingDtypes.for_precision("fp16", ReduceDtype.fp16, cast_params=True).policy()
    assert (fp16.param_dtype, fp16.reduce_dtype) == (torch.float16, torch.float16)
    fp32 = ShardingDtypes.for_precision("fp32", None)
    assert not fp32.casts_params
    assert fp32.policy(output_fp32=True).param_dtype is None
    assert fp32.policy(output_fp32=True).output_dtype is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["precision.reduce_dtype=bf16"], "needs trainer.strategy=fsdp2"),
        (["trainer.strategy=fsdp2", "precision.reduce_dtype=fp16"], "needs precision=fp16"),
        (["trainer.strategy=fsdp3"], r"expected one of \[ddp, fsdp2\]"),
        (["trainer.strategy=fsdp2", "trainer.channels_last=true"], "only contiguous parameters"),
        (["precision.fsdp_cast_params=true"], "needs trainer.strategy=fsdp2"),
        (
            ["trainer.strategy=fsdp2", "precision=fp32", "precision.fsdp_cast_params=true"],
            "precision=fp32 has no dtype to cast the parameters to; valid choices: bf16, fp16",
        ),
        (["trainer.strategy=fsdp2", "optimizer.fused=true"], "no fused SGD kernel"),
        (
            [
                "precision=fp8",
                "precision.emulate=true",
                "precision.options.recipe=rowwise_with_gw_hp",
                "precision.options.skip_small=true",
            ],
            "no size thresholds",
        ),
    ],
)
def test_reduce_dtype_and_strategy_are_checked_before_anything_runs(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_overrides(overrides)


def test_fsdp2_without_torchrun_trains_as_a_group_of_one_and_closes_it(run_cfg, tmp_path):
    summary = train(run_cfg(*FSDP, "precision=bf16"), tmp_path)

    assert not dist.is_initialized()
    assert (summary["status"], summary["strategy"], summary["world_size"]) == (
        "completed",
        "fsdp2",
        1,
    )
    assert (summary["param_dtype"], summary["reduce_dtype"]) == ("fp32", "fp32")
    assert summary["checks"]["master_weights_fp32"]["passed"] is True
    step_dir = tmp_path / "checkpoints" / "step_00000004"
    assert sorted(p.name for p in step_dir.iterdir()) == [".metadata", "__0_0.distcp", "engine.pt"]


def test_ddp_runs_in_one_process_say_so(run_cfg, tmp_path):
    summary = train(run_cfg(*TINY), tmp_path)
    assert (summary["strategy"], summary["param_dtype"], summary["reduce_dtype"]) == (
        "single",
        "fp32",
        None,
    )


def test_each_block_is_sharded_then_the_root_and_batchnorm_keeps_fp32_weights():
    with process_group(DeviceChoice.cpu, Strategy.fsdp2):
        dtypes = ShardingDtypes.for_precision("bf16", None, cast_params=True)
        model = Blocks()
        blocks = shard_model(model, dtypes, torch.device("cpu"), model_blocks(model))
        assert all(isinstance(block, FSDPModule) for block in blocks.blocks)
        assert isinstance(blocks, FSDPModule) and not isinstance(blocks.head, FSDPModule)
        out = blocks(torch.randn(2, 4))
        assert out.dtype == torch.float32

        cnn = shard_model(TinyCNN(3, 10, 4), dtypes, torch.device("cpu"))
        norms = [m for m in cnn.modules() if isinstance(m, nn.BatchNorm2d)]
        assert norms and all(isinstance(m, FSDPModule) for m in norms)
        # A bf16 forward with fp32 BatchNorm statistics runs (with bf16 weights it would not).
        cnn(torch.randn(2, 3, 8, 8)).sum().backward()
        assert all(p.grad.dtype == torch.float32 for p in cnn.parameters())


def saved_activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes the forward keeps for the backward outside any checkpointed region."""
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(x).sum()
    loss.backward()
    return sum(saved)


def test_activation_checkpointing_recomputes_blocks_keeping_less_and_changing_nothing():
    torch.manual_seed(0)
    plain = Blocks(width=32)
    checkpointed = Blocks(width=32)
    checkpointed.load_state_dict(plain.state_dict())
    checkpoint_blocks(checkpointed, "blocks")
    assert all(isinstance(block, CheckpointWrapper) for block in checkpointed.blocks)
    x = torch.randn(64, 4)

    kept_plain = saved_activation_bytes(plain, x)
    kept_checkpointed = saved_activation_bytes(checkpointed, x)

    assert kept_checkpointed < kept_plain / 4
    # Same names in the state dict, same gradients bit for bit.
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_activation_checkpointing_on_a_model_without_blocks_is_one_line(run_cfg):
    with pytest.raises(ConfigError, match="model mlp has none; set it to false"):
        build(run_cfg("model=mlp", "trainer.activation_checkpointing=true"))


def test_compile_compiles_each_block_in_place_or_else_the_whole_model():
    blocks = Blocks()
    names = list(blocks.state_dict())
    compile_blocks(blocks, CompileMode.default)
    assert all(block._compiled_call_impl is not None for block in blocks.blocks)
    assert blocks._compiled_call_impl is None and list(blocks.state_dict()) == names
    cnn = TinyCNN(3, 10, 4)
    compile_blocks(cnn, CompileMode.default)
    assert cnn._compiled_call_impl is not None


@pytest.mark.slow
def test_fsdp2_with_compile_trains_like_eager(run_cfg, tmp_path):
    """The model is compiled (in place, before sharding) and trains to about eager's loss."""
    # No evaluation: an eval-mode forward would compile a second graph, and adds nothing here.
    # The MLP: bf16 convolutions on this CPU cost far more a step, compiled or not.
    run = [*TINY_MLP, "trainer.strategy=fsdp2", "precision=bf16", "trainer.eval_every=null"]
    eager = train(run_cfg(*run), tmp_path / "eager")
    compiled = train(run_cfg(*run, "trainer.compile=true"), tmp_path / "c")
    assert compiled["status"] == "completed" and compiled["compile"] is True
    assert compiled["final_loss"] == pytest.approx(eager["final_loss"], abs=1e-3)


def test_a_half_written_or_incomplete_sharded_checkpoint_is_never_taken(run_cfg, tmp_path):
    """A save killed mid-write leaves .step_<N>.tmp/, never step_<N>/; a step directory without
    DCP's .metadata is passed over for an older one."""
    run = [*FSDP, "precision=fp32", "checkpoint.every_steps=2", "checkpoint.keep=2"]
    train(run_cfg(*run), tmp_path)
    checkpoints = tmp_path / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000002", "step_00000004"]
    half_written = checkpoints / ".step_00000006.tmp"
    shutil.copytree(checkpoints / "step_00000004", half_written)
    (checkpoints / "step_00000004" / ".metadata").unlink()

    summary = train(run_cfg(*run, "trainer.max_steps=6", "resume=auto"), tmp_path)

    assert summary["resumed_from"] == str(checkpoints / "step_00000002")
    assert summary["steps"] == 6 and not half_written.exists()
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_00000004", "step_00000006"]


def test_a_checkpoint_keeps_one_strategy(run_cfg, tmp_path):
    train(run_cfg(*TINY), tmp_path)
    with pytest.raises(ConfigError, match=re.escape('trainer.strategy: "ddp" -> "fsdp2"')):
        train(run_cfg(*FSDP, "resume=auto"), tmp_path)


def rank_of(rank: int, world_size: int) -> Placement:
    return Placement(0, torch.device("cpu"), WorkerRank(rank, world_size, rank))


@pytest.mark.parametrize(("saved", "now"), [(2, 1), (1, 2), (4, 3)])
def test_on_another_world_size_the_epoch_goes_on_from_the_samples_trained_on(saved, now):
    """No sample of the epoch is left out, and less than one global batch is seen again."""
    size, batch, trained_batches = 96, 4, 3
    seen = {
        i
        for rank in range(saved)
        for i in list(EpochShuffleSampler(size, rank_of(rank, saved)))[: trained_batches * batch]
    }
    progress = data_position({"batch_in_epoch": trained_batches}, saved, now)
    rest = []
    for rank in range(now):
        sampler = EpochShuffleSampler(size, rank_of(rank, now))
        sampler.set_epoch(0, start=progress["batch_in_epoch"] * batch)
        rest += list(sampler)
    assert seen | set(rest) == set(range(size))
    assert len(seen & set(rest)) < now * batch


GPT = [
    *TINY_GPT,
    "dataset=synthetic_tokens",
    "trainer.strategy=fsdp2",
    "trainer.device=cpu",
    "trainer.max_steps=4",
    "trainer.log_every=2",
    "trainer.eval_batches=2",
    "wandb.mode=disabled",
]


def test_gpt_blocks_are_each_checkpointed_then_sharded(compose_cfg):
    cfg = validate(compose_cfg(*GPT, "trainer.activation_checkpointing=true", fast=False))
    with process_group(cfg.trainer.device, cfg.trainer.strategy) as alone:
        model = build(cfg, distributed=alone).model
        assert all(isinstance(block, FSDPModule) for block in model.blocks)
        assert all(isinstance(block, CheckpointWrapper) for block in model.blocks)


def test_gpt_with_activation_checkpointing_ends_where_gpt_without_it_does(compose_cfg, tmp_path):
    """Recomputing the blocks changes what the forward keeps, not what training computes."""
    plain = train(validate(compose_cfg(*GPT, fast=False)), tmp_path / "plain")
    checkpointed = train(
        validate(compose_cfg(*GPT, "trainer.activation_checkpointing=true", fast=False)),
        tmp_path / "checkpointed",
    )
    assert checkpointed["final_loss"] == plain["final_loss"]
    assert checkpointed["eval_loss"] == plain["eval_loss"]


def test_the_reduce_sweep_preset_passes_preflight_with_an_image_model():
    check_overrides(["experiment=fsdp_reduce_sweep", "model=tiny_cnn", "dataset=synthetic"])
