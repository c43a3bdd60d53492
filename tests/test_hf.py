"""Hugging Face transformers models (model=hf): built by type or loaded from a local folder,
checked before anything is built, trained in every precision, their FLOPs and their blocks."""

from __future__ import annotations

import copy
import math
import re
from importlib.metadata import PackageNotFoundError
from pathlib import Path

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule
from torch.utils.flop_counter import FlopCounterMode

from amp_exp.config import hf
from amp_exp.config.preflight import check_overrides
from amp_exp.config.values import validate
from amp_exp.errors import ConfigError
from amp_exp.run import build, train
from amp_exp.runtime.distributed import process_group
from amp_exp.tasks.blocks import model_blocks
from amp_exp.tasks.hf import HFModel, hf_flops_per_token
from amp_exp.tasks.sampling import Placement
from amp_exp.tasks.workload import build_workload
from helpers.runs import FAST_TRAINER, TINY_TOKENS, composed, signal_self_at_call
from test_checkpoint import assert_same_state
from test_lm import EXACT, without_token_rates

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parent.parent
ON_CPU = Placement(0, torch.device("cpu"))
LLAMA = ["model=hf_llama_tiny", *TINY_TOKENS, "dataset.seq_len=16"]
GPT2 = [
    "model=hf",
    "model.name=gpt2",
    "+model.config.n_layer=2",
    "+model.config.n_embd=32",
    "+model.config.n_head=2",
    "+model.config.n_positions=16",
    *TINY_TOKENS,
]
# fp16 autocast on the CPU is 20-140x slower than fp32: two steps of four sequences of 8 tokens.
FP16_TINY = ["trainer.max_steps=2", "dataset.batch_size=4", "dataset.seq_len=8"]


@pytest.fixture
def hf_cfg(compose_cfg):
    def _hf_cfg(*overrides: str):
        return validate(compose_cfg(*FAST_TRAINER, *overrides, fast=False))

    return _hf_cfg


@pytest.fixture(scope="module")
def llama_fp32(tmp_path_factory) -> dict:
    """The summary of the tiny llama's eager fp32 run, trained once for the tests that read it
    or measure another setting against it."""
    cfg = validate(copy.deepcopy(composed((*FAST_TRAINER, *LLAMA, "precision=fp32"))))
    return train(cfg, tmp_path_factory.mktemp("llama_fp32"))


# --- checked before anything is built ---------------------------------------------------------


def test_an_unknown_model_type_is_refused_in_one_line_that_names_valid_ones():
    with pytest.raises(ConfigError) as refused:
        check_overrides(["model=hf", "model.name=not_a_model", "dataset=synthetic_tokens"])
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("model.name='not_a_model' is not a transformers model type")
    assert "gpt2, llama, mistral, qwen2" in message


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["model.name=lama"], "valid types include llama"),
        (
            ["+model.config.hiden_size=8"],
            "not an attribute of the llama config; close ones: hidden",
        ),
        (["model.config.rms_norm_eps=0.1"], "add it with +model.config.rms_norm_eps=0.1"),
        (["model=hf", "model.name=vit"], "has no AutoModelForCausalLM"),
        (["dataset.seq_len=64"], "exceeds the llama config's max_position_embeddings=32"),
        (["+model.config.vocab_size=16"], "vocabulary (16, model.config.vocab_size) is smaller"),
        (["model.path=/no/such/folder"], "model.path=/no/such/folder: no such directory"),
        # Sizes by meaning (issue 35 item 5): transformers builds a GPT-2 without blocks from
        # n_layer=-1, whose FLOP count came out negative.
        (
            ["model=hf", "model.name=gpt2", "+model.config.n_layer=-1"],
            "model.config.n_layer=-1 must be an integer of 1 or more (a size, layer or head",
        ),
        (["model.config.num_hidden_layers=0"], "model.config.num_hidden_layers=0 must be an"),
        (["model.config.num_attention_heads=-2"], "model.config.num_attention_heads=-2 must"),
        (["model.config.hidden_size=0"], "model.config.hidden_size=0 must be an integer of 1"),
        (["model.config.num_key_value_heads=true"], "num_key_value_heads=True must be an int"),
    ],
)
def test_a_bad_hf_value_is_one_line_before_anything_is_built(overrides, expected):
    model = [] if overrides[0].startswith("model=") else ["model=hf_llama_tiny"]
    with pytest.raises(ConfigError) as refused:
        check_overrides([*model, *TINY_TOKENS, *overrides])
    assert expected in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("found", "expected"),
    [
        (PackageNotFoundError("transformers"), "not installed: pip install 'amp_exp[hf]'"),
        ("4.30.0", "needs transformers>=4.46, found 4.30.0: pip install 'amp_exp[hf]' --upgrade"),
    ],
)
def test_missing_or_old_transformers_says_how_to_install_it(monkeypatch, found, expected):
    def version(name: str) -> str:
        if isinstance(found, Exception):
            raise found
        return found

    monkeypatch.setattr(hf, "version", version)
    with pytest.raises(ConfigError, match=r"^model=hf needs transformers") as refused:
        check_overrides(["model=hf_llama_tiny", "dataset=synthetic_tokens"])
    assert str(refused.value).endswith(expected)


def test_the_hf_extra_asks_for_the_version_the_check_wants_and_dev_includes_it():
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'hf = ["transformers>={hf.MIN_TRANSFORMERS}"]' in pyproject
    (dev_extras,) = re.findall(r'"amp_exp\[([a-z0-9,-]+)\]",\n    "pytest', pyproject)
    assert "hf" in dev_extras.split(",")


# --- the model: names, blocks, FLOPs ----------------------------------------------------------


def test_transformers_names_every_module_under_the_hf_prefix(hf_cfg):
    model = build_workload(hf_cfg(*LLAMA, "precision=fp32"), ON_CPU).model
    q_proj = dict(model.named_modules())["hf.model.layers.0.self_attn.q_proj"]
    assert isinstance(model, HFModel) and isinstance(q_proj, torch.nn.Linear)
    saved = {f"hf.{key}" for key in model.hf.state_dict()}
    assert set(model.state_dict()) == saved
    assert model_blocks(model) is model.hf.model.layers
    gpt2 = build_workload(hf_cfg(*GPT2, "precision=fp32"), ON_CPU).model
    assert model_blocks(gpt2) is gpt2.hf.transformer.h


def tiny_llama(**config) -> HFModel:
    settings = {
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 96,
        **config,
    }
    config = transformers.AutoConfig.for_model("llama", **settings)
    return HFModel(transformers.AutoModelForCausalLM.from_config(config), "input_ids")


def test_flops_per_token_count_grouped_query_attention_and_swiglu_as_they_are():
    model, seq_len = tiny_llama(), 16
    d, layers, heads, kv_heads, head_dim, inner, vocab = 64, 2, 4, 2, 16, 176, 96
    attention = d * heads * head_dim + 2 * d * kv_heads * head_dim + heads * head_dim * d
    swiglu = 3 * d * inner  # gate, up and down
    norms = 2 * d
    # The token embedding is looked up, not multiplied; the untied output head is a matmul.
    n = layers * (attention + swiglu + norms) + d + vocab * d
    expected = 6 * n + 12 * layers * heads * head_dim * seq_len
    assert hf_flops_per_token(model, seq_len) == expected


def test_a_flop_count_of_zero_or_less_is_refused_never_reported():
    # What transformers builds from num_hidden_layers=-1 (refused in the config, but possible
    # from a folder): no layers, and 6N + 12·(-1)·4·16·64 = -11,904 FLOPs per token.
    model = tiny_llama(num_hidden_layers=-1)
    with pytest.raises(ConfigError, match=r"come to -11904 .* not a positive count"):
        hf_flops_per_token(model, 64)


def test_flops_formula_is_within_10_percent_of_torchs_flop_counter():
    model = tiny_llama(attn_implementation="eager")  # matmuls the counter sees
    tokens = torch.randint(96, (4, 16))
    with FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    measured = counter.get_total_flops() / tokens.numel()
    assert measured == pytest.approx(hf_flops_per_token(model, 16), rel=0.10)


def test_a_language_model_reports_tokens_per_s_tflops_and_flops_per_token(llama_fp32):
    summary = llama_fp32
    assert summary["status"] == "completed"
    assert summary["flops_per_token"] == hf_flops_per_token(tiny_llama(vocab_size=32), 16)
    assert summary["tokens_per_s"] > 0 and summary["tflops"] > 0
    assert summary["config"]["model"]["name"] == "llama"


# --- trained in every precision ---------------------------------------------------------------


@pytest.mark.parametrize("model", ["llama", "gpt2"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_tiny_gpt2_and_llama_by_name_train_in_bf16_and_fp16(hf_cfg, tmp_path, model, precision):
    overrides = LLAMA if model == "llama" else GPT2
    summary = train(hf_cfg(*overrides, f"precision={precision}", *FP16_TINY), tmp_path)
    assert (summary["status"], summary["precision"], summary["steps"]) == (
        "completed",
        precision,
        2,
    )
    # Finite, and no worse than a model that knows nothing would be (log of the vocabulary).
    assert summary["eval_loss"] < 1.2 * math.log(32)


def test_a_stopped_and_resumed_gpt2_ends_bit_for_bit_where_an_uninterrupted_one_does(
    hf_cfg, override_loss, tmp_path
):
    """GPT-2's dropout (0.1 by default) draws from the random state the checkpoint carries."""
    run = [*GPT2, *EXACT, "precision=fp32"]
    train(hf_cfg(*run), tmp_path / "whole")
    override_loss(signal_self_at_call(5))
    first = train(hf_cfg(*run), tmp_path / "split")
    assert (first["status"], first["steps"]) == ("stopped", 5)
    assert train(hf_cfg(*run, "resume=auto"), tmp_path / "split")["steps"] == 12
    ends = [
        torch.load(tmp_path / name / "checkpoints" / "last.pt", weights_only=True)
        for name in ("whole", "split")
    ]
    for part in ("model", "optimizer", "scheduler", "progress"):
        assert_same_state(ends[0][part], ends[1][part], part)
    rows = [without_token_rates(tmp_path / name / "metrics.jsonl") for name in ("whole", "split")]
    assert rows[0] == rows[1]


def test_bf16_true_keeps_norms_and_rotary_frequencies_fp32_and_never_rounds_them(hf_cfg, tmp_path):
    built = build(hf_cfg(*LLAMA, "precision=bf16_true"))
    model = built.model
    rotary = model.hf.model.rotary_emb
    assert rotary.inv_freq.dtype == torch.float32
    assert torch.equal(rotary.inv_freq, rotary.original_inv_freq)  # never through bf16
    assert model.hf.model.norm.weight.dtype == torch.float32
    assert model.hf.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    summary = train(hf_cfg(*LLAMA, "precision=bf16_true"), tmp_path)
    assert summary["status"] == "completed" and summary["precision"] == "bf16_true"


def test_emulated_fp8_converts_the_llamas_linear_layers_by_their_transformers_names(
    hf_cfg, tmp_path
):
    pytest.importorskip("torchao")
    summary = train(hf_cfg(*LLAMA, "precision=fp8", "precision.emulate=true"), tmp_path)
    assert summary["status"] == "completed"
    details = summary["precision_details"]
    assert "hf.model.layers.1.mlp.down_proj" in details["converted_linears"]
    assert "hf.model.layers.0.self_attn.q_proj" in details["converted_linears"]
    assert details["skipped_linears"] == {"hf.lm_head": "precision.options.skip: hf.lm_head"}


def test_activation_checkpointing_recomputes_decoder_layers_and_changes_no_result(
    hf_cfg, llama_fp32, tmp_path
):
    plain = llama_fp32
    built = build(hf_cfg(*LLAMA, "precision=fp32", "trainer.activation_checkpointing=true"))
    assert all(isinstance(layer, CheckpointWrapper) for layer in built.model.hf.model.layers)
    checkpointed = train(
        hf_cfg(*LLAMA, "precision=fp32", "trainer.activation_checkpointing=true"), tmp_path / "ac"
    )
    assert checkpointed["final_loss"] == plain["final_loss"]


def test_compile_trains_the_llama_to_eager_s_loss(hf_cfg, llama_fp32, tmp_path, monkeypatch):
    """aot_eager traces forward and backward as inductor would, without its code generation."""
    import torch._dynamo

    real_compile = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda model, mode: real_compile(model, backend="aot_eager")
    )
    torch._dynamo.reset()
    eager = llama_fp32
    compiled = train(hf_cfg(*LLAMA, "precision=fp32", "trainer.compile=true"), tmp_path / "c")
    torch._dynamo.reset()
    assert compiled["compile"] is True
    assert compiled["final_loss"] == pytest.approx(eager["final_loss"], abs=1e-4)


def test_fsdp2_shards_each_decoder_layer_after_checkpointing_it(hf_cfg):
    cfg = hf_cfg(*LLAMA, "trainer.strategy=fsdp2", "trainer.activation_checkpointing=true")
    with process_group(cfg.trainer.device, cfg.trainer.strategy) as alone:
        model = build(cfg, distributed=alone).model
        layers = model.hf.model.layers
        assert all(isinstance(layer, FSDPModule) for layer in layers)
        assert all(isinstance(layer, CheckpointWrapper) for layer in layers)
        assert model_blocks(model) is layers


@pytest.mark.parametrize(("positions", "expected"), [(32, 32), (32768, hf.DEFAULT_SEQ_LEN)])
def test_without_dataset_seq_len_a_sequence_is_the_models_positions_up_to_a_cap(
    hf_cfg, positions: int, expected: int
) -> None:
    """Issue 37: qwen2's 32,768 positions became the sequence length, and one batch asked for
    16 GiB."""
    from amp_exp.tasks.workload import token_seq_len

    cfg = hf_cfg(
        "model=hf_llama_tiny",
        *TINY_TOKENS,
        f"model.config.max_position_embeddings={positions}",
    )
    assert cfg.dataset.seq_len is None
    assert token_seq_len(cfg) == expected


def test_a_batch_that_does_not_fit_in_memory_names_seq_len_and_batch_size(
    hf_cfg, monkeypatch
) -> None:
    from amp_exp.tasks import workload

    def out_of_memory(*args, **kwargs):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: not enough memory: you "
            "tried to allocate 17179869184 bytes."
        )

    cfg = hf_cfg(*LLAMA, "dataset.batch_size=4")
    monkeypatch.setattr(workload.LanguageModelTask, "output_problem", out_of_memory)
    with pytest.raises(ConfigError) as refused:
        build(cfg)
    assert str(refused.value).endswith(
        "tried to allocate 17179869184 bytes.; a smaller dataset.seq_len (now 16) or "
        "dataset.batch_size (now 4) fits in less memory"
    )
