"""The precision audit: what one training step actually ran in, the bytes it saved for backward,
and a warning naming the modules when the requested precision did not engage."""

from __future__ import annotations

import logging

import pytest
import torch

import ddp_jobs
from amp_exp.config.precisions import get
from amp_exp.errors import ConfigError
from amp_exp.run import build, train
from amp_exp.training.audit import matmuls
from amp_exp.training.audit.matmuls import BACKWARD, FORWARD, MatmulFlops
from amp_exp.training.audit.verdict import judge
from helpers.runs import FAST_LM, TINY

HELPERS = "helpers.user_code"
# 8x8 images: the input layer is narrow, so the fp32 island holds most matmul FLOPs.
SMALL_IMAGES = ["dataset.image_size=8", "dataset.batch_size=16"]


def fp32_island(kind: str) -> list[str]:
    return [
        "model=custom",
        f"model._target_={HELPERS}.make_with_fp32_matmuls",
        f"+model.kwargs.kind={kind}",
        *SMALL_IMAGES,
    ]


def did_not_engage(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "did not engage" in r.getMessage()]


def test_gpt_tiny_in_bf16_runs_most_matmul_flops_in_bfloat16_and_names_the_rest(
    compose_cfg, tmp_path
) -> None:
    from amp_exp.config.values import validate

    summary = train(validate(compose_cfg(*FAST_LM, "precision=bf16", fast=False)), tmp_path)
    audit = summary["precision_audit"]
    assert audit["engaged"] is True
    assert audit["flops_by_dtype"]["bfloat16"] > 0.5
    # The rest, if any, is accounted for module by module.
    share = audit["flops_by_dtype"]["bfloat16"]
    others = [
        f for dtypes in audit["modules"].values() for d, f in dtypes.items() if d != "bfloat16"
    ]
    assert sum(others) == pytest.approx((1 - share) * audit["matmul_flops"])
    assert {"blocks.0.attn.qkv", "blocks.0.attn", "blocks.0.mlp.fc", "lm_head"} <= set(
        audit["modules"]
    )
    # The counted FLOPs are the model's: 6N + 12LHQT per token, less the biases and norms it
    # counts and the embedding lookups.
    tokens = summary["batch_size"] * summary["config"]["model"]["seq_len"]
    assert audit["matmul_flops"] == pytest.approx(summary["flops_per_token"] * tokens, rel=0.1)
    assert audit["backward"]["matmul_flops"] == pytest.approx(
        2 * audit["forward"]["matmul_flops"], rel=0.1
    )


def test_fp32_runs_every_matmul_in_float32(run_cfg, tmp_path) -> None:
    summary = train(run_cfg("precision=fp32", *TINY), tmp_path)
    audit = summary["precision_audit"]
    assert audit["engaged"] is True
    assert audit["flops_by_dtype"] == {"float32": 1.0}
    assert audit["forward"]["flops_by_dtype"] == audit["backward"]["flops_by_dtype"]
    assert set(audit["modules"]) == {"features.0", "features.3", "head"}
    assert audit["higher_precision_modules"] == {} and audit["tf32"] is None
    state = audit["state"]
    assert set(state["weights"]) == set(state["grads"]) == set(state["optimizer_state"])
    kept = state["weights"]["float32"] + state["optimizer_state"]["float32"]
    assert kept == summary["state_bytes"]


def test_a_conv_model_on_the_cpu_saves_fewer_activation_bytes_in_bf16_than_fp32(
    run_cfg, tmp_path
) -> None:
    saved = {
        precision: train(run_cfg(f"precision={precision}"), tmp_path / precision)[
            "precision_audit"
        ]["saved_activation_bytes"]
        for precision in ("fp32", "bf16")
    }
    assert saved["bf16"]["total"] < 0.6 * saved["fp32"]["total"]
    assert saved["bf16"]["by_dtype"]["bfloat16"] > saved["bf16"]["by_dtype"].get("float32", 0)
    assert set(saved["fp32"]["by_dtype"]) <= {"float32", "int64"}


@pytest.mark.parametrize(
    ("kind", "precision"),
    [("autocast_off", "bf16"), ("custom_fwd", "bf16"), ("float_weights", "bf16_true")],
)
def test_a_model_that_keeps_its_matmuls_in_fp32_did_not_engage_and_is_named(
    kind, precision, run_cfg, tmp_path, caplog
) -> None:
    with caplog.at_level(logging.WARNING, logger="amp_exp"):
        audit = train(run_cfg(f"precision={precision}", *fp32_island(kind)), tmp_path)[
            "precision_audit"
        ]
    assert audit["engaged"] is False
    assert audit["flops_by_dtype"]["float32"] > 0.5
    # The island itself, or (autocast_off) the linear layer inside it.
    assert audit["responsible"] and all(name.startswith("island") for name in audit["responsible"])
    assert audit["higher_precision_modules"].keys() == audit["responsible"].keys()
    (warning,) = did_not_engage(caplog)
    assert f"precision={precision} did not engage" in warning and "island" in warning


@pytest.mark.parametrize("precision", ["bf16", "bf16_true"])
def test_modules_kept_in_fp32_are_reported_as_a_flop_share_and_not_held_against_the_precision(
    precision, run_cfg, tmp_path, caplog
) -> None:
    overrides = [*fp32_island("autocast_off"), "precision.keep_fp32=[island]"]
    with caplog.at_level(logging.WARNING, logger="amp_exp"):
        audit = train(run_cfg(f"precision={precision}", *overrides), tmp_path)["precision_audit"]
    kept = sum(
        flops
        for module, dtypes in audit["modules"].items()
        if module == "island" or module.startswith("island.")
        for flops in dtypes.values()
    )
    assert audit["keep_fp32_flop_share"] == pytest.approx(kept / audit["matmul_flops"])
    assert audit["keep_fp32_flop_share"] > 0.5
    # What is kept computes in fp32; the rest engages.
    assert audit["modules"]["island.linear"].keys() == {"float32"}
    assert audit["engaged"] is True and not did_not_engage(caplog)


def test_without_keep_fp32_the_audit_has_no_kept_share(run_cfg, tmp_path) -> None:
    audit = train(run_cfg("precision=bf16", *SMALL_IMAGES), tmp_path)["precision_audit"]
    assert audit["keep_fp32_flop_share"] is None


def test_autocast_for_the_wrong_device_type_did_not_engage(
    run_cfg, tmp_path, caplog, monkeypatch
) -> None:
    """A runner that asks for CUDA autocast while the model runs on the CPU (Lightning #21815)."""
    monkeypatch.setattr(
        get("bf16"), "forward_context", lambda self: torch.autocast("cuda", dtype=torch.bfloat16)
    )
    with caplog.at_level(logging.WARNING, logger="amp_exp"):
        audit = train(run_cfg("precision=bf16", *TINY), tmp_path)["precision_audit"]
    assert audit["engaged"] is False and audit["flops_by_dtype"] == {"float32": 1.0}
    (warning,) = did_not_engage(caplog)
    assert "0% of matmul FLOPs ran in bfloat16" in warning and "features.3" in warning


def test_emulated_fp8_runs_float8_matmuls_in_the_converted_linears_only(run_cfg, tmp_path) -> None:
    cfg = run_cfg(
        "precision=fp8",
        "precision.emulate=true",
        "model=mlp",
        "model.hidden_dim=64",
        "model.depth=3",
        *SMALL_IMAGES,
    )
    summary = train(cfg, tmp_path)
    audit = summary["precision_audit"]
    assert audit["engaged"] is True
    details = summary["precision_details"]
    assert details["converted_linears"] and details["skipped_linears"]
    for name in details["converted_linears"]:
        assert {"float8_e4m3fn", "float8_e5m2"} <= set(audit["modules"][name])
    for name in details["skipped_linears"]:
        assert set(audit["modules"][name]) == {"bfloat16"}
    assert set(audit["forward"]["flops_by_dtype"]) == {"float8_e4m3fn", "bfloat16"}


def test_fp8_that_converts_no_linear_layer_stops_before_training(run_cfg) -> None:
    with pytest.raises(ConfigError) as raised:
        build(run_cfg("precision=fp8", "precision.emulate=true", *TINY))
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("precision=fp8 converted no linear layer (head: ")


def test_converted_linears_without_a_float8_matmul_are_named() -> None:
    flops = MatmulFlops()
    flops.flops[("fc1", FORWARD, "float8_e4m3fn")] = 100
    flops.flops[("fc2", FORWARD, "bfloat16")] = 100
    flops.flops[("fc2", BACKWARD, "bfloat16")] = 200
    verdict = judge(get("fp8").spec, flops, {}, converted=["fc1", "fc2"])
    assert verdict.engaged is False
    assert verdict.shortfalls == [
        "1 of the 2 converted linears ran no float8_e4m3fn or float8_e5m2 matmul"
    ]
    assert verdict.responsible == {"fc2": {"bfloat16": 0.75}}


def test_the_audited_step_is_the_first_timed_one_or_the_one_asked_for(run_cfg, tmp_path) -> None:
    default = train(run_cfg(*TINY, "trainer.timing_warmup_steps=2"), tmp_path / "default")
    assert default["precision_audit"]["step"] == 3
    # Off the clock: its time, samples and step are left out of throughput.
    assert default["timed_steps"] == 4 - 2 - 1
    asked = train(run_cfg(*TINY, "diagnostics.audit_step=4"), tmp_path / "asked")
    assert asked["precision_audit"]["step"] == 4


def test_the_audited_step_trains_exactly_as_any_other(run_cfg) -> None:
    from amp_exp.build import attach_audit

    def trained(*overrides: str):
        cfg = run_cfg("precision=bf16", *TINY, *overrides)
        built = build(cfg)
        audit = attach_audit(cfg, built)
        built.engine.fit(lambda row: None)
        return built.model.state_dict(), audit

    audited, audit = trained()
    plain, no_audit = trained("diagnostics.audit=false")
    assert audit is not None and audit.summary()["step"] == 2 and no_audit is None
    assert audited.keys() == plain.keys()
    assert all(torch.equal(audited[k], plain[k]) for k in audited)


def test_turning_the_audit_off_never_enters_the_dispatch_mode(
    run_cfg, tmp_path, monkeypatch
) -> None:
    entered = []
    original = matmuls.MatmulRecorder.__enter__

    def counting(self):
        entered.append(self)
        return original(self)

    monkeypatch.setattr(matmuls.MatmulRecorder, "__enter__", counting)
    off = train(run_cfg(*TINY, "diagnostics.audit=false"), tmp_path / "off")
    assert entered == [] and off["precision_audit"] is None
    train(run_cfg(*TINY), tmp_path / "on")
    assert len(entered) == 1


def test_with_gradient_accumulation_the_saved_bytes_are_those_of_one_forward(run_cfg, tmp_path):
    def saved(*overrides: str) -> dict:
        summary = train(run_cfg(*TINY, *overrides), tmp_path / str(len(overrides)))
        return summary["precision_audit"]["saved_activation_bytes"]

    assert saved("trainer.grad_accum_steps=2") == saved()


def test_an_audit_step_below_1_is_refused_in_one_line(compose_cfg) -> None:
    from amp_exp.config.values import validate

    with pytest.raises(ConfigError, match=r"^diagnostics.audit_step must be 1 or more, or null"):
        validate(compose_cfg("diagnostics.audit_step=0"))


def test_flops_by_module_splits_any_step_by_module_and_dtype() -> None:
    """What a per-module precision choice reads: the FLOP share each module ran in each dtype."""
    from helpers.user_code import make_with_fp32_matmuls

    model = make_with_fp32_matmuls((8,), num_classes=4, kind="autocast_off", width=16)
    x = torch.randn(2, 8)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x).float().sum()
        loss.backward()  # outside autocast, which would cast the backward's matmuls too

    found = matmuls.flops_by_module(model, model, step)
    # Forward 2*m*n*k; backward the weight gradient, and the input's but in the first layer.
    assert found == {
        "embed": {"bfloat16": 2 * 2 * 8 * 16 * 2},
        "island.linear": {"float32": 2 * 2 * 16 * 16 * 3},
        "head": {"bfloat16": 2 * 2 * 16 * 4 * 3},
    }


# --- names and counts with checkpointing, keep_fp32 and fp8 ------------------------------------

KEEP_MLP = "precision.keep_fp32=[blocks.0.mlp]"
CHECKPOINTED = "trainer.activation_checkpointing=true"
# Where gpt_tiny's matmuls run: its linears, and each attention's scaled-dot-product.
GPT_MATMUL_MODULES = {
    f"blocks.{i}.{name}"
    for i in (0, 1)
    for name in ("attn", "attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
} | {"lm_head"}


def gpt_audit(compose_cfg, tmp_path, *overrides: str) -> dict:
    from amp_exp.config.values import validate

    run_dir = tmp_path / "-".join(o.split("=")[0] for o in overrides)
    cfg = validate(compose_cfg(*FAST_LM, *overrides, "model.dropout=0.1", fast=False))
    return train(cfg, run_dir)["precision_audit"]


def test_each_matmul_belongs_to_the_module_that_ran_it_and_no_dropout_owns_one(
    compose_cfg, tmp_path
) -> None:
    audit = gpt_audit(compose_cfg, tmp_path, "precision=bf16", KEEP_MLP)
    modules = audit["modules"]
    # Fails when a backward matmul lands on whichever module's hook fired last (a Dropout).
    assert set(modules) == GPT_MATMUL_MODULES
    # The two blocks are the same shape: the same FLOPs, module for module.
    for name in ("attn", "attn.qkv", "attn.proj", "mlp.fc"):
        assert sum(modules[f"blocks.0.{name}"].values()) == sum(
            modules[f"blocks.1.{name}"].values()
        )
    assert modules["blocks.0.mlp.fc"] == {"float32": sum(modules["blocks.1.mlp.fc"].values())}
    assert audit["recompute"]["matmul_flops"] == 0


def test_checkpointing_leaves_names_shares_and_backward_as_without_it(compose_cfg, tmp_path):
    plain = gpt_audit(compose_cfg, tmp_path, "precision=bf16", KEEP_MLP)
    checkpointed = gpt_audit(compose_cfg, tmp_path, "precision=bf16", KEEP_MLP, CHECKPOINTED)
    # The wrapper's _checkpoint_wrapped_module is not in the names keep_fp32 is matched on.
    assert checkpointed["modules"] == plain["modules"]
    assert checkpointed["keep_fp32_flop_share"] == plain["keep_fp32_flop_share"] > 0.2
    assert checkpointed["flops_by_dtype"] == plain["flops_by_dtype"]
    # The recomputed forward is counted as recompute, not as backward.
    assert checkpointed["backward"] == plain["backward"]
    assert 0 < checkpointed["recompute"]["matmul_flops"] <= plain["forward"]["matmul_flops"]


def test_emulated_fp8_engages_with_checkpointing(compose_cfg, tmp_path) -> None:
    fp8 = ["precision=fp8", "precision.emulate=true"]
    audit = gpt_audit(compose_cfg, tmp_path, *fp8, CHECKPOINTED)
    assert audit["engaged"] is True, audit["shortfalls"]
    assert "float8_e4m3fn" in audit["modules"]["blocks.0.mlp.fc"]
    assert not any("_checkpoint_wrapped_module" in name for name in audit["modules"])


# gpt_tiny's small run in bf16 under FSDP2, in one process and (in the session's shared launch,
# tests/ddp_jobs.py) on two ranks.
FSDP2_AUDIT_RUN = [*FAST_LM, "precision=bf16", "trainer.strategy=fsdp2", "trainer.eval_every=null"]
FSDP2_AUDIT = ddp_jobs.declare("audit_fsdp2", *FSDP2_AUDIT_RUN)


@pytest.mark.slow
def test_two_fsdp2_ranks_count_each_module_as_one_rank_does_times_two(
    compose_cfg, tmp_path, shared_rank_jobs
):
    """Before, the FSDP2 hooks moved backward matmuls between modules: mlp.fc and mlp.proj,
    the same shape, got 134M and 67M FLOPs."""
    one = train(validate_lm(compose_cfg, *FSDP2_AUDIT_RUN), tmp_path / "one")["precision_audit"]
    ranks = shared_rank_jobs[1][FSDP2_AUDIT]
    two = ranks[0]["summary"]["precision_audit"]
    assert two["ranks"] == 2
    assert two["modules"] == {
        name: {dtype: 2 * flops for dtype, flops in dtypes.items()}
        for name, dtypes in one["modules"].items()
    }
    assert set(one["modules"]) == GPT_MATMUL_MODULES


def validate_lm(compose_cfg, *overrides: str):
    from amp_exp.config.values import validate

    return validate(compose_cfg(*overrides, fast=False))
