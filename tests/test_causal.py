"""The causal check of task=lm (issue 35 item 4): before training, a model whose logits at a
position change when only later tokens change is refused in one line that names the likely
cause; every causal model (gpt, hf gpt2 and llama, the user's own) passes it untouched."""

from __future__ import annotations

import json

import pytest
import torch

from amp_exp.config.values import validate
from amp_exp.errors import ConfigError
from amp_exp.tasks.sampling import Placement
from amp_exp.tasks.workload import build_workload, check_causal
from helpers.runs import FAST_TRAINER, TINY_GPT, TINY_TOKENS, run_cli

ON_CPU = Placement(0, torch.device("cpu"))
HELPERS = "helpers.user_code"
SEQ_16 = "dataset.seq_len=16"
HF_GPT2 = [
    "model=hf",
    "model.name=gpt2",
    "+model.config.n_layer=1",
    "+model.config.n_embd=16",
    "+model.config.n_head=2",
    "+model.config.n_positions=16",
]
HF_LLAMA = ["model=hf_llama_tiny", SEQ_16]
HF_BERT = [
    "model=hf",
    "model.name=bert",
    "+model.config.num_hidden_layers=1",
    "+model.config.hidden_size=16",
    "+model.config.num_attention_heads=2",
    "+model.config.intermediate_size=32",
    "+model.config.max_position_embeddings=16",
]


def custom(name: str, *kwargs: str) -> list[str]:
    return ["model=custom", f"model._target_={HELPERS}.{name}", *kwargs, SEQ_16]


@pytest.fixture
def workload(compose_cfg):
    def _workload(*overrides: str):
        cfg = validate(compose_cfg(*FAST_TRAINER, *TINY_TOKENS, *overrides, fast=False))
        return cfg, build_workload(cfg, ON_CPU)

    return _workload


def refusal(workload, *overrides: str) -> str:
    with pytest.raises(ConfigError) as refused:
        workload(*overrides)
    message = str(refused.value)
    assert "\n" not in message and "fails the causal check of task=lm" in message
    return message


@pytest.mark.parametrize(
    "model",
    [
        TINY_GPT,
        # Dropout draws new masks in each forward: in training mode every logit would move.
        [*TINY_GPT, "model.dropout=0.5"],
        HF_GPT2,
        HF_LLAMA,
        custom("make_lm"),
        # BERT's causal variant, which the refusal below points to.
        [*HF_BERT, "+model.config.is_decoder=true"],
    ],
    ids=["gpt", "gpt-dropout", "hf-gpt2", "hf-llama", "custom", "hf-bert-decoder"],
)
def test_a_causal_model_passes_the_check(workload, model):
    if model[0] == "model=hf" or model[0].startswith("model=hf_"):
        pytest.importorskip("transformers")
    workload(*model)


HF_XLM = [
    "model=hf",
    "model.name=xlm",
    "+model.config.emb_dim=16",
    "+model.config.n_layers=1",
    "+model.config.n_heads=2",
    "+model.config.max_position_embeddings=16",
    "model.attn_implementation=eager",
]


@pytest.mark.parametrize(
    ("model", "cause"),
    [
        (
            HF_BERT,
            "the bert type is an encoder; its causal variant, BertLMHeadModel, masks later "
            "tokens only with +model.config.is_decoder=true",
        ),
        # XLM's causal-LM class has no is_decoder to set.
        (HF_XLM, "XLMWithLMHeadModel, the xlm type's causal-LM class, sees later tokens even so"),
    ],
    ids=["bert", "xlm"],
)
def test_an_hf_encoder_on_tokens_is_refused_and_told_of_its_causal_variant(workload, model, cause):
    pytest.importorskip("transformers")
    message = refusal(workload, *model)
    assert message.startswith(f"model=hf {model[1]} fails")
    assert "logits up to position" in message and cause in message


@pytest.mark.slow
def test_the_cli_refuses_bert_on_synthetic_tokens_in_one_line_with_exit_2(tmp_path):
    """The red team's case as they ran it: BERT's default size, no model.config."""
    pytest.importorskip("transformers")
    result = run_cli(
        *FAST_TRAINER,
        "model=hf",
        "model.name=bert",
        *TINY_TOKENS,
        SEQ_16,
        f"hydra.run.dir={tmp_path}",
        expect_rc=2,
    )
    errors = [line for line in result.stdout.splitlines() if "[ERROR]" in line]
    assert len(errors) == 1 and "Traceback" not in result.stdout + result.stderr
    assert "fails the causal check" in errors[0] and "BertLMHeadModel" in errors[0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "causal check" in summary["error"]


@pytest.mark.parametrize(
    "model",
    [
        custom("make_encoder"),
        # One leak between two neighbours: only a cut at the first position, or at the
        # second-to-last, lies between them.
        custom("make_peeking", "+model.kwargs.at=0"),
        custom("make_peeking", "+model.kwargs.at=-2"),
    ],
    ids=["encoder", "peeks-into-first", "peeks-into-second-to-last"],
)
def test_a_model_that_sees_later_tokens_is_refused_as_a_likely_encoder(workload, model):
    message = refusal(workload, *model)
    assert message.startswith(f"model._target_={model[1].split('=')[1]} fails")
    assert "likely an encoder such as BERT" in message


def test_a_model_that_fails_in_eval_mode_is_refused_in_one_line(workload):
    with pytest.raises(ConfigError) as refused:
        workload(*custom("make_training_only"))
    message = str(refused.value)
    assert "\n" not in message
    assert message.endswith(
        "fails in eval mode (the causal check of task=lm) on one batch: RuntimeError: only trains"
    )


def test_the_check_leaves_the_training_mode_and_every_generator_as_they_were(workload):
    cfg, built = workload(*TINY_GPT, "model.dropout=0.5")
    model, batch = built.model, next(iter(built.data.train))
    model.train()
    before = torch.get_rng_state()
    check_causal(built.task, model, batch, cfg)
    assert all(module.training for module in model.modules())
    assert torch.equal(torch.get_rng_state(), before)
