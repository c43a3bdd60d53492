"""Models and data as users write them: dict and tuple samples, transformers outputs,
attention through functional calls (issue 44)."""

from __future__ import annotations

import pytest
import torch

from amp_exp.config.validate import validate
from amp_exp.errors import ConfigError
from amp_exp.run import train
from amp_exp.tasks.lm import LanguageModelTask
from helpers.runs import FAST_TRAINER

transformers = pytest.importorskip("transformers")

HELPERS = "helpers.user_code"
TOKEN_DICTS = [
    "dataset=custom",
    f"dataset._target_={HELPERS}.make_token_dicts",
    "task=lm",
    "dataset.vocab_size=16",
    "dataset.batch_size=8",
]
TINY_HF_GPT2 = [
    "model=hf",
    "model.name=gpt2",
    "+model.config.n_layer=1",
    "+model.config.n_embd=16",
    "+model.config.n_head=2",
    "+model.config.n_positions=8",
]


def tiny_gpt2(**config) -> torch.nn.Module:
    settings = dict(n_layer=1, n_embd=16, n_head=2, n_positions=8, vocab_size=16)
    config = transformers.AutoConfig.for_model("gpt2", **{**settings, **config})
    return transformers.AutoModelForCausalLM.from_config(config)


# --- dict and tuple samples ------------------------------------------------------------------


def test_dict_labels_are_shifted_so_the_loss_is_transformers_own_loss() -> None:
    """A dict's labels sit at their own token (transformers' convention): taken as next tokens
    unshifted, the model would learn to copy its input, and the loss would differ from the
    model's own; -100 (padding) is not predicted."""
    from helpers.user_code import make_token_dicts

    train_split, _ = make_token_dicts(0)
    batch = torch.utils.data.default_collate(train_split[:4])
    task = LanguageModelTask(torch.device("cpu"), 8, 16)
    model = tiny_gpt2().eval()  # no dropout: the two losses see one forward
    inputs, targets = task.to_device(batch)
    assert "labels" not in inputs  # the model computes no loss of its own
    with torch.no_grad():
        own = model(**inputs, labels=batch["labels"]).loss
        ours = task.loss(model, (inputs, targets))
    assert float(ours) == pytest.approx(float(own), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize(
    "model",
    [TINY_HF_GPT2, ["model=custom", f"model._target_={HELPERS}.make_transformers_gpt2"]],
    ids=["hf", "custom"],
)
def test_transformers_style_dict_samples_train_a_language_model(compose_cfg, tmp_path, model):
    """Refused before as "not an (input, target) pair: Could not infer dtype of dict"; a
    transformers model as model=custom was refused for returning a ModelOutput."""
    cfg = validate(compose_cfg(*FAST_TRAINER, *model, *TOKEN_DICTS, fast=False))
    summary = train(cfg, tmp_path)
    assert summary["status"] == "completed"
    assert summary["eval_loss"] is not None and summary["eval_loss"] < 10


@pytest.mark.slow
def test_transformers_style_dict_samples_train_a_sequence_classifier(compose_cfg, tmp_path):
    cfg = validate(
        compose_cfg(
            *FAST_TRAINER,
            *TINY_HF_GPT2,
            "+model.config.pad_token_id=0",
            "dataset=custom",
            f"dataset._target_={HELPERS}.make_token_class_dicts",
            "task=classification",
            "dataset.num_classes=2",
            "dataset.batch_size=8",
            fast=False,
        )
    )
    summary = train(cfg, tmp_path)
    assert summary["status"] == "completed" and summary["eval_acc"] is not None


@pytest.mark.slow
def test_a_model_of_a_tuple_of_inputs_is_called_with_each(compose_cfg, tmp_path):
    """((points, scale), label) samples: model(points, scale), never model((points, scale))."""
    cfg = validate(
        compose_cfg(
            *FAST_TRAINER,
            "dataset=custom",
            f"dataset._target_={HELPERS}.make_pairs_of_inputs",
            "task=classification",
            "dataset.num_classes=3",
            "dataset.batch_size=16",
            "model=custom",
            f"model._target_={HELPERS}.make_two_inputs",
            fast=False,
        )
    )
    summary = train(cfg, tmp_path)
    assert summary["status"] == "completed" and summary["eval_acc"] is not None


def test_a_dict_sample_without_labels_is_one_line_naming_where_the_target_goes(
    compose_cfg, tmp_path
):
    data = [f"dataset._target_={HELPERS}.make_unlabelled_token_dicts"]
    cfg = validate(compose_cfg(*FAST_TRAINER, *TINY_HF_GPT2, *TOKEN_DICTS, *data, fast=False))
    with pytest.raises(ConfigError) as refused:
        train(cfg, tmp_path)
    message = str(refused.value)
    assert "\n" not in message and "a dict sample holds its target under 'labels'" in message
