"""Every config option composes and validates; every bad input fails early with one line."""

from __future__ import annotations

import functools
from dataclasses import fields

import pytest

from amp_exp.config.datasets import (
    dataset_name,
)
from amp_exp.config.models import TinyCNNConfig, TorchvisionModelConfig
from amp_exp.config.plain import plain_run_config, run_config_from_plain
from amp_exp.config.preflight import CONF_DIR, check_overrides
from amp_exp.config.schema import SCHEMAS, AdamWConfig, SGDConfig
from amp_exp.config.values import validate
from amp_exp.errors import ConfigError

GROUPS = (
    "model",
    "dataset",
    "optimizer",
    "scheduler",
    "precision",
    "trainer",
    "wandb",
    "report",
    "sensitivity",
)
# Options that need a value the YAML cannot know, or a partner of the other kind of data.
REQUIRED = {
    ("model", "torchvision"): ["model.name=mobilenet_v3_small"],
    ("model", "timm"): ["model.name=resnet18"],
    ("model", "custom"): ["model._target_=torch.nn.Identity"],
    ("model", "gpt_tiny"): ["dataset=synthetic_tokens"],
    ("model", "gpt2_small"): ["dataset=synthetic_tokens"],
    ("model", "hf"): ["model.name=gpt2", "dataset=synthetic_tokens"],
    ("model", "hf_gpt2"): ["dataset=synthetic_tokens"],
    ("model", "hf_llama_tiny"): ["dataset=synthetic_tokens"],
    ("dataset", "image_folder"): [f"dataset.root={CONF_DIR}"],
    # The tests run on the CPU, where fp8 is emulated or refused.
    ("precision", "fp8"): ["precision.emulate=true"],
    ("precision", "mxfp8"): ["precision.emulate=true"],
    ("precision", "mxfp4"): ["precision.emulate=true"],
    ("precision", "nvfp4"): ["precision.emulate=true"],
    ("dataset", "synthetic_tokens"): ["model=gpt_tiny"],
    ("dataset", "text"): ["model=gpt_tiny", f"dataset.path={CONF_DIR}"],
    ("dataset", "custom"): [
        "dataset._target_=torch.utils.data.TensorDataset",
        "task=classification",
        "dataset.num_classes=10",
    ],
}
# Options named otherwise than the value they select; hf models are named by their type.
SELECTS = {("precision", "bf16_true_nearest"): "bf16_true"}
MODEL_NAMES = {"hf": "gpt2", "hf_gpt2": "gpt2", "hf_llama_tiny": "llama"}
# The shrinking overrides (conftest.FAST) name image keys, which other data does not have.
NOT_IMAGES = {"gpt_tiny", "gpt2_small", "hf", "hf_gpt2", "hf_llama_tiny"}
NOT_IMAGES |= {"synthetic_tokens", "text", "custom"}


def all_options() -> list[tuple[str, str]]:
    return [(g, p.stem) for g in GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))]


def test_every_group_has_options() -> None:
    options = all_options()
    for group in GROUPS:
        assert any(g == group for g, _ in options), group


@pytest.mark.parametrize(("group", "option"), all_options())
def test_every_option_composes_and_validates(compose_cfg, group: str, option: str) -> None:
    overrides = [f"{group}={option}", *REQUIRED.get((group, option), [])]
    fast = not (group in ("model", "dataset") and option in NOT_IMAGES)
    cfg = validate(compose_cfg(*overrides, fast=fast))
    section = getattr(cfg, group)
    if group == "model" and option not in ("torchvision", "timm"):
        assert section.name == MODEL_NAMES.get(option, option)
    if group == "dataset":
        assert dataset_name(section) == option
    if group == "scheduler":
        assert section.name.value == SELECTS.get((group, option), option)
    if group == "precision":
        assert section.name == SELECTS.get((group, option), option)
    if group == "report":
        assert section.tolerance is None  # each task's own default


def test_group_options_pick_their_schema(run_cfg) -> None:
    assert isinstance(run_cfg().model, TinyCNNConfig)
    assert isinstance(run_cfg("model=resnet18").model, TorchvisionModelConfig)
    assert isinstance(run_cfg("optimizer=adamw").optimizer, AdamWConfig)
    assert isinstance(run_cfg("optimizer=sgd").optimizer, SGDConfig)
    assert run_cfg("precision=bf16").precision.name == "bf16"


def test_defaults_are_the_documented_ones(compose_cfg) -> None:
    cfg = validate(compose_cfg(fast=False))
    assert (cfg.model.name, cfg.dataset.name.value, cfg.precision.name) == (
        "tiny_cnn",
        "synthetic",
        "auto",
    )
    assert cfg.precision.init_scale == 65536.0
    assert cfg.precision.clip_grad_norm is None
    assert (cfg.wandb.mode.value, cfg.wandb.project, cfg.wandb.log_every) == (
        "auto",
        "amp_exp",
        None,
    )
    assert cfg.wandb.init_timeout + 10 <= 30  # W&B's import and offline start fit in the rest


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["precision=fp4"], "valid choices: auto, bf16, bf16_true, bf16_true_nearest, fp16"),
        (
            ["model=nope"],
            "valid choices: custom, gpt2_small, gpt_tiny, hf, hf_gpt2, hf_llama_tiny, mlp, "
            "resnet18, resnet50, timm, tiny_cnn, torchvision",
        ),
        (["trainer.max_steps=abc"], "trainer.max_steps=abc: Value 'abc'"),
        (["dataset.batch_size=-4"], "dataset.batch_size=-4 must be positive"),
        (["trainer.foo=1"], "trainer.foo is not a known key; valid keys: activation_checkpointing"),
        (["+trainer.foo=1"], "trainer.foo is not a known key"),
        # The registry's precisions, not the presets of conf/precision/.
        (
            ["precision.name=fp4"],
            "precision=fp4 is not a precision; valid choices: auto, fp32, bf16, fp16, bf16_true, "
            "fp8",
        ),
        (["model=torchvision", "model.name=nope"], "valid choices: alexnet"),
        (["dataset=image_folder", "dataset.root=/no/such/dir"], "dataset=image_folder needs"),
        (["model=torchvision"], "model.name must be set"),
        (["trainer.max_steps=null"], "set trainer.max_steps or trainer.epochs"),
        (["precision.backoff_factor=2"], "precision.backoff_factor must lie strictly between"),
        (["-m", "precision=fp32,fp4"], "precision=fp4 is not an option"),
        (["-m", "trainer.max_steps=3,0"], "trainer.max_steps=0 must be positive"),
        (["wandb.mode=sometimes"], "expected one of [auto, online, offline, disabled]"),
        (["wandb.log_every=30"], "wandb.log_every=30 must be a multiple of trainer.log_every=25"),
        (["wandb.init_timeout=0"], "wandb.init_timeout=0.0 must be positive"),
        (["wandb.project=' '"], "wandb.project must not be empty"),
        ([f"wandb.tags=[ok,{'x' * 65}]"], "is longer than 64 characters"),
        (["wandb.api_key=secret"], "wandb.api_key is not a known key"),
        (["report.tolerance=-1"], "report.tolerance must be 0 or more"),
        (["report.wandb_timeout=0"], "report.wandb_timeout=0.0 must be positive"),
        (["experiment=init_scale_sweep", "precision.init_scale=8,-2"], "init_scale must be pos"),
        (
            [
                "dataset=custom",
                "dataset._target_=helpers.user_code.make_counting",
                "task=lm",
                "dataset.vocab_size=-1",
            ],
            "dataset.vocab_size=-1 must be 2 or more, or null",
        ),
        (
            [
                "dataset=custom",
                "dataset._target_=helpers.user_code.make_labelled_vectors",
                "task=classification",
                "dataset.num_classes=0",
            ],
            "dataset.num_classes=0 must be positive or null",
        ),
    ],
)
def test_bad_input_is_rejected_with_one_line(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as raised:
        check_overrides(overrides)
    message = str(raised.value)
    assert expected in message
    assert "\n" not in message


def test_good_sweep_passes_preflight() -> None:
    check_overrides(["-m", "precision=fp32,fp16,bf16", "model=tiny_cnn,mlp"])


def validated_configs(monkeypatch, argv: list[str]) -> set[tuple[str, str]]:
    """The (model, precision) of every config the preflight validates for ``argv``."""
    seen = set()

    def spy(cfg):
        seen.add((cfg.model.name, cfg.precision.name))
        return validate(cfg)

    monkeypatch.setattr("amp_exp.config.preflight.validate", spy)
    check_overrides(argv)
    return seen


@functools.cache
def preset_preflight(preset: str) -> frozenset[tuple[str, str]]:
    """``validated_configs`` of ``experiment=preset``, once a session: a preset's sweep composes
    a config a job, and two tests read the one of precision_sweep."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return frozenset(validated_configs(monkeypatch, [f"experiment={preset}"]))


@pytest.mark.parametrize("preset", [p.stem for p in sorted((CONF_DIR / "experiment").glob("*"))])
def test_every_preset_passes_preflight(preset: str) -> None:
    preset_preflight(preset)


def test_preflight_checks_every_value_a_preset_sweeps(monkeypatch) -> None:
    seen = preset_preflight("precision_sweep")
    assert {model for model, _ in seen} == {"tiny_cnn", "resnet18"}
    assert {precision for _, precision in seen} >= {"fp32", "fp16", "bf16"}
    # A value on the command line replaces the preset's sweep of that key, as in Hydra.
    seen = validated_configs(monkeypatch, ["experiment=precision_sweep", "model=mlp"])
    assert {model for model, _ in seen} == {"mlp"}


def test_cli_rejects_bad_value_before_building_anything(amp_exp_here, tmp_path) -> None:
    """The pre-flight refuses it before Hydra starts, so the entry point runs in this process."""
    result = amp_exp_here("precision=fp4", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "amp_exp: error: precision=fp4 is not an option; valid choices: auto, bf16, bf16_true, "
        "bf16_true_nearest, fp16, fp32, fp8, mxfp4, mxfp8, nvfp4"
    ]
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "run").exists()


def test_every_schema_of_a_group_has_fields_of_its_own() -> None:
    """What lets a plain config (summary.json's) find its way back to its schemas."""
    for group, schemas in SCHEMAS.items():
        field_sets = [frozenset(f.name for f in fields(schema)) for schema in schemas.values()]
        assert len(set(field_sets)) == len(field_sets), group


@pytest.mark.parametrize(
    "overrides",
    [
        ("model=mlp", "precision=bf16_true_nearest", "seed=3"),
        ("model=torchvision", "model.name=mobilenet_v3_small", "optimizer=adamw"),
        ("model=gpt_tiny", "dataset=synthetic_tokens", "speed.precisions=[bf16]"),
    ],
)
def test_a_plain_config_turns_back_into_the_run_config_it_came_from(
    compose_cfg, overrides: tuple[str, ...]
) -> None:
    cfg = validate(compose_cfg(*overrides, fast=False))
    assert run_config_from_plain(plain_run_config(cfg)) == cfg
