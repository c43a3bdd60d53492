"""The user's own model and data by _target_, timm models, and models that cannot train."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from amp_exp.config.preflight import check_overrides
from amp_exp.config.values import validate
from amp_exp.errors import ConfigError, RuntimeFault
from amp_exp.run import build, train
from amp_exp.tasks.custom import accepted
from helpers.runs import FAST_TRAINER, TINY_GPT, TINY_TOKENS

HELPERS = "helpers.user_code"
TESTS_DIR = Path(__file__).resolve().parent


def custom_model(name: str) -> list[str]:
    return ["model=custom", f"model._target_={HELPERS}.{name}"]


def one_line_config_error(call) -> str:
    with pytest.raises(ConfigError) as raised:
        call()
    message = str(raised.value)
    assert "\n" not in message
    return message


# --- the user's model ------------------------------------------------------------------------


def test_custom_classifier_gets_the_image_facts_and_its_kwargs(run_cfg, tmp_path) -> None:
    cfg = run_cfg(*custom_model("make_classifier"), "+model.kwargs.hidden=64")
    summary = train(cfg, tmp_path)
    assert summary["status"] == "completed" and summary["task"] == "classification"
    assert summary["model"] == "custom"
    # 3x16x16 inputs -> 64 hidden -> 10 classes, with biases.
    assert summary["parameters"] == (768 * 64 + 64) + (64 * 10 + 10)
    assert summary["eval_acc"] is not None and summary["tokens_per_s"] is None


def test_custom_language_model_trains_on_tokens_with_tokens_per_second(
    compose_cfg, tmp_path
) -> None:
    cfg = validate(
        compose_cfg(
            *FAST_TRAINER, *TINY_TOKENS, *custom_model("make_lm"), "dataset.seq_len=16", fast=False
        )
    )
    summary = train(cfg, tmp_path)
    assert summary["status"] == "completed" and summary["task"] == "lm"
    assert summary["tokens_per_s"] == pytest.approx(summary["samples_per_s"] * 16)
    assert summary["eval_perplexity"] > 1
    # No FLOPs formula for a model amp_exp did not write: no TFLOP/s, no MFU.
    assert summary["flops_per_token"] is None and summary["tflops"] is None


def test_facts_are_offered_as_the_signature_accepts() -> None:
    offered = {"num_classes": 3, "input_shape": (1, 2, 2)}

    def takes_classes(num_classes, hidden=3): ...

    def takes_anything(**kwargs): ...

    assert accepted(takes_classes, offered) == {"num_classes": 3}
    assert accepted(takes_anything, offered) == offered


def test_a_callable_taking_kwargs_gets_every_fact_as_python_values(run_cfg) -> None:
    built = build(run_cfg(*custom_model("make_anything")))
    facts = built.model[1].facts
    assert facts == {"input_shape": (3, 16, 16), "num_classes": 10}


# --- the user's data ---------------------------------------------------------------------


def test_custom_data_with_a_custom_model_classifies(compose_cfg, tmp_path) -> None:
    cfg = validate(
        compose_cfg(
            *FAST_TRAINER,
            "dataset=custom",
            f"dataset._target_={HELPERS}.make_labelled_vectors",
            "task=classification",
            "dataset.num_classes=3",
            *custom_model("make_classifier"),
            fast=False,
        )
    )
    summary = train(cfg, tmp_path)
    assert summary["status"] == "completed" and summary["dataset"] == "custom"
    assert summary["parameters"] == (8 * 16 + 16) + (16 * 3 + 3)


def test_custom_token_data_trains_gpt(compose_cfg, tmp_path) -> None:
    cfg = validate(
        compose_cfg(
            *FAST_TRAINER,
            *TINY_GPT,
            "dataset=custom",
            f"dataset._target_={HELPERS}.make_counting",
            "+dataset.kwargs.seq_len=12",
            "task=lm",
            "dataset.vocab_size=11",
            "dataset.batch_size=8",
            fast=False,
        )
    )
    summary = train(cfg, tmp_path)
    assert summary["status"] == "completed" and summary["task"] == "lm"
    assert summary["tokens_per_s"] == pytest.approx(summary["samples_per_s"] * 12)
    assert summary["flops_per_token"] > 0


def test_custom_data_must_say_its_task_and_size(compose_cfg) -> None:
    base = [*FAST_TRAINER, "dataset=custom", f"dataset._target_={HELPERS}.make_counting"]
    message = one_line_config_error(lambda: validate(compose_cfg(*base, fast=False)))
    assert "needs task=classification or task=lm" in message
    message = one_line_config_error(
        lambda: validate(compose_cfg(*base, *TINY_GPT, "task=lm", fast=False))
    )
    assert "needs dataset.vocab_size=N" in message


# --- timm ------------------------------------------------------------------------------


def test_any_timm_model_trains_by_name(run_cfg, tmp_path) -> None:
    pytest.importorskip("timm")
    summary = train(run_cfg("model=timm", "model.name=test_efficientnet"), tmp_path)
    assert summary["status"] == "completed" and summary["model"] == "test_efficientnet"


# --- bad input: one line, before training ------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["model=custom", "model._target_=no_such_pkg.make_model"],
            "model._target_=no_such_pkg.make_model cannot be imported",
        ),
        (["model=custom"], "model._target_ must be set"),
        (["model=timm", "model.name=no_such_net"], "is not a timm model"),
        (
            ["dataset=custom", "dataset._target_=helpers.nope.make", "task=lm"],
            "dataset._target_=helpers.nope.make cannot be imported",
        ),
    ],
)
def test_unusable_target_is_rejected_before_anything_is_built(overrides, expected) -> None:
    message = one_line_config_error(lambda: check_overrides(overrides))
    assert expected in message


def test_a_callable_that_fails_on_its_arguments_is_one_line(run_cfg) -> None:
    cfg = run_cfg(*custom_model("make_classifier"), "+model.kwargs.depth=3")
    message = one_line_config_error(lambda: build(cfg))
    assert message.startswith(f"model._target_={HELPERS}.make_classifier failed on its arguments")
    assert "depth=3" in message and "TypeError" in message


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (custom_model("make_wrong_width"), "returns logits of shape [32, 11], expected [32, 10]"),
        # torchvision's googlenet returns its auxiliary classifiers' logits too while training
        # (and warns that its weight initialization will change).
        pytest.param(
            ["model=torchvision", "model.name=googlenet"],
            "returns GoogLeNetOutputs, not a tensor",
            marks=pytest.mark.filterwarnings("ignore::FutureWarning"),
        ),
        # vit_b_32 asserts that images are 224 pixels.
        (["model=torchvision", "model.name=vit_b_32"], "AssertionError: Wrong image height"),
    ],
)
def test_a_model_whose_output_does_not_fit_the_task_stops_before_training(
    run_cfg, overrides, expected
) -> None:
    message = one_line_config_error(lambda: build(run_cfg(*overrides)))
    assert "cannot train on dataset=synthetic" in message and expected in message


@pytest.mark.parametrize(
    ("kind", "found"),
    [
        ("none", "it has no parameters"),
        ("integer", "none of its 1 parameters requires a gradient (all frozen or integer)"),
        ("frozen", "none of its 4 parameters requires a gradient (all frozen or integer)"),
    ],
)
def test_a_model_with_nothing_to_train_is_one_line(run_cfg, kind, found) -> None:
    cfg = run_cfg(*custom_model("make_untrainable"), f"+model.kwargs.kind={kind}")
    message = one_line_config_error(lambda: build(cfg))
    assert message == (
        f"model=custom has nothing to train: {found}; give it floating-point parameters with "
        "requires_grad=True"
    )


def badly_labelled(kind: str) -> list[str]:
    return [
        *FAST_TRAINER,
        "dataset=custom",
        f"dataset._target_={HELPERS}.make_badly_labelled",
        f"+dataset.kwargs.kind={kind}",
        "task=classification",
        "dataset.num_classes=3",
        "dataset.batch_size=16",
        *custom_model("make_classifier"),
    ]


@pytest.mark.parametrize(
    ("kind", "problem"),
    [
        ("too_large", "its labels hold 5, outside [0, 3) for 3 classes (dataset.num_classes)"),
        ("negative", "its labels hold -3, outside [0, 3) for 3 classes (dataset.num_classes)"),
        ("float", "its labels are torch.float32, not one class index in [0, 3) per sample"),
        ("one_hot", "its labels have shape [16, 3], not [16]: one class index in [0, 3) per"),
        ("two_d", "its labels have shape [16, 1], not [16]"),
    ],
)
def test_labels_a_loss_cannot_take_stop_the_run_before_training_in_one_line(
    compose_cfg, kind, problem
) -> None:
    cfg = validate(compose_cfg(*badly_labelled(kind), fast=False))
    message = one_line_config_error(lambda: build(cfg))
    assert (
        message.startswith("model=custom cannot train on dataset=custom: ") and problem in message
    )


@pytest.mark.parametrize(
    ("vocab_size", "problem"),
    [
        # make_counting counts modulo 16: ids up to 15 in a vocabulary of 11.
        (11, "its inputs hold token id 15, outside the vocabulary [0, 11) (dataset.vocab_size)"),
        (16, None),
    ],
)
def test_token_ids_beyond_the_vocabulary_stop_the_run_before_training(
    compose_cfg, vocab_size, problem
) -> None:
    cfg = validate(
        compose_cfg(
            *FAST_TRAINER,
            "dataset=custom",
            f"dataset._target_={HELPERS}.make_counting",
            "+dataset.kwargs.vocab_size=16",
            "task=lm",
            f"dataset.vocab_size={vocab_size}",
            "dataset.batch_size=8",
            *custom_model("make_lm"),
            fast=False,
        )
    )
    if problem is None:
        build(cfg)
        return
    assert problem in one_line_config_error(lambda: build(cfg))


def test_the_guides_own_data_trains_an_mlp(compose_cfg, tmp_path) -> None:
    """16-dimensional points, as docs/custom_models.md's my_pkg.make_data makes them."""
    cfg = validate(
        compose_cfg(
            *FAST_TRAINER,
            "dataset=custom",
            f"dataset._target_={HELPERS}.make_blobs",
            "task=classification",
            "dataset.num_classes=4",
            "dataset.batch_size=16",
            "model=mlp",
            "model.hidden_dim=8",
            fast=False,
        )
    )
    summary = train(cfg, tmp_path)
    assert summary["status"] == "completed" and summary["eval_acc"] is not None


@pytest.mark.parametrize("exit_at", [1, 3], ids=["in the output check", "while training"])
def test_a_model_that_calls_sys_exit_fails_the_run_in_one_line(run_cfg, tmp_path, exit_at) -> None:
    cfg = run_cfg(*custom_model("make_exiting"), f"+model.kwargs.exit_at={exit_at}")
    with pytest.raises(RuntimeFault) as raised:
        train(cfg, tmp_path)
    assert str(raised.value) == (
        "the run's model or data code raised SystemExit(0); amp_exp stopped the run: remove the "
        "sys.exit() call from it"
    )


def test_the_output_check_leaves_no_trace_in_batchnorm_statistics(run_cfg) -> None:
    built = build(run_cfg())
    batchnorm = built.model.features[1]
    assert int(batchnorm.num_batches_tracked) == 0
    assert float(batchnorm.running_mean.abs().sum()) == 0.0


# --- as a user runs it ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "task_overrides",
    [
        [*custom_model("make_classifier"), "+model.kwargs.hidden=8"],
        [*custom_model("make_lm"), "dataset=synthetic_tokens", "dataset.seq_len=16"],
    ],
    ids=["classification", "lm"],
)
def test_cli_trains_a_model_from_a_module_on_pythonpath(
    tmp_path, monkeypatch, amp_exp_here, task_overrides
) -> None:
    """Through the entry point, in this process, with the tests' folder on its path as
    PYTHONPATH puts a user's module on a process's."""
    monkeypatch.syspath_prepend(str(TESTS_DIR))
    shrink = [] if "dataset=synthetic_tokens" in task_overrides else ["dataset.image_size=8"]
    result = amp_exp_here(*FAST_TRAINER, *task_overrides, *shrink, f"hydra.run.dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"


@pytest.mark.slow
def test_cli_a_model_that_calls_sys_exit_exits_4_with_one_line_and_a_summary(
    tmp_path, monkeypatch, amp_exp_here
) -> None:
    """Through the entry point, in this process: a SystemExit the model raises is the run's
    failure (exit 4), not the end of the process that runs it."""
    monkeypatch.syspath_prepend(str(TESTS_DIR))
    result = amp_exp_here(
        *FAST_TRAINER,
        *custom_model("make_exiting"),
        "+model.kwargs.exit_at=3",
        "dataset.image_size=8",
        f"hydra.run.dir={tmp_path}",
    )
    assert result.returncode == 4, result.stderr[-2000:]
    errors = [line for line in result.stdout.splitlines() if "[ERROR]" in line]
    assert len(errors) == 1 and "raised SystemExit(0)" in errors[0]
    assert "Traceback" not in result.stdout + result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "SystemExit(0)" in summary["error"]


@pytest.mark.slow
def test_cli_unimportable_target_exits_2_with_one_line(tmp_path, monkeypatch, amp_exp_here) -> None:
    """Through the entry point, in this process: the pre-flight refuses it, writing nothing."""
    monkeypatch.chdir(tmp_path)
    result = amp_exp_here("model=custom", "model._target_=my_pkg.make_model")
    assert result.returncode == 2
    assert list(tmp_path.iterdir()) == []
    assert result.stderr.strip().splitlines() == [
        "amp_exp: error: model._target_=my_pkg.make_model cannot be imported "
        "(ModuleNotFoundError: No module named 'my_pkg'); is its package installed or its folder "
        "on PYTHONPATH?"
    ]
