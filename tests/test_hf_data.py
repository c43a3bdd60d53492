"""Hugging Face models from local folders and on every kind of data: a save_pretrained folder,
a local tokenizer on text, image and sequence classification, and two ranks under FSDP2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import ddp_jobs
from amp_exp.config.preflight import check_overrides
from amp_exp.config.values import validate
from amp_exp.errors import ConfigError
from amp_exp.run import train
from amp_exp.tasks.sampling import Placement
from amp_exp.tasks.workload import build_workload
from helpers.runs import FAST_TRAINER, TINY_TOKENS
from helpers.warm_python import python_m

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

ON_CPU = Placement(0, torch.device("cpu"))
CORPUS = " ".join(["the cat sat on the mat and the dog ran in the park"] * 100)


@pytest.fixture
def hf_cfg(compose_cfg):
    def _hf_cfg(*overrides: str, fast: bool = False):
        return validate(compose_cfg(*FAST_TRAINER, *overrides, fast=fast))

    return _hf_cfg


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    """A tiny Llama written by save_pretrained, with a vocabulary of 32."""
    folder = tmp_path_factory.mktemp("saved_llama")
    config = transformers.AutoConfig.for_model(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        vocab_size=32,
        max_position_embeddings=16,
    )
    torch.manual_seed(123)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A BPE tokenizer trained on the corpus (vocabulary 33), saved as transformers saves one."""
    folder = tmp_path_factory.mktemp("tokenizer")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]", "</s>"])
    bpe.train_from_iterator([CORPUS], trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="[UNK]", eos_token="</s>"
    )
    fast.save_pretrained(folder)
    return folder


def test_a_saved_model_loads_from_its_folder_with_its_weights(hf_cfg, saved_llama, tmp_path):
    cfg = hf_cfg("model=hf", f"model.path={saved_llama}", *TINY_TOKENS, "precision=fp32")
    assert cfg.model.name == "llama"  # from the folder's config.json
    model = build_workload(cfg, ON_CPU).model
    saved = transformers.AutoModelForCausalLM.from_pretrained(saved_llama).state_dict()
    for name, tensor in model.hf.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    summary = train(cfg, tmp_path)
    assert summary["status"] == "completed" and summary["parameters"] == sum(
        p.numel() for p in model.parameters()
    )


def test_a_saved_model_keeps_its_shapes(saved_llama):
    with pytest.raises(ConfigError, match=r"^the model's vocabulary \(32, model.path's config\)"):
        check_overrides(["model=hf", f"model.path={saved_llama}", "dataset=synthetic_tokens"])
    with pytest.raises(ConfigError, match=r"holds a llama model; leave model\.name out"):
        check_overrides(["model=hf", "model.name=gpt2", f"model.path={saved_llama}"])


def test_a_folder_whose_config_has_no_layers_is_refused_before_anything_is_built(
    saved_llama, tmp_path
):
    config = json.loads((saved_llama / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 0}))
    with pytest.raises(ConfigError, match=r"its config sets num_hidden_layers=0, which must be"):
        check_overrides(["model=hf", f"model.path={tmp_path}", "dataset=synthetic_tokens"])


def test_a_local_tokenizer_tokenizes_text_for_the_model(hf_cfg, tokenizer_dir, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    text = [
        "dataset=text",
        f"dataset.path={corpus}",
        "dataset.tokenizer=hf",
        f"dataset.tokenizer_path={tokenizer_dir}",
        "dataset.batch_size=8",
        "dataset.seq_len=16",
    ]
    vocab = len(transformers.AutoTokenizer.from_pretrained(tokenizer_dir))
    cfg = hf_cfg("model=hf_llama_tiny", *text, "precision=fp32")
    workload = build_workload(cfg, ON_CPU)
    assert workload.data.facts["vocab_size"] == vocab
    assert workload.model.hf.config.vocab_size == vocab
    inputs, _ = next(iter(workload.data.train))
    assert int(inputs.min()) >= 0 and int(inputs.max()) < vocab
    assert train(cfg, tmp_path / "run")["status"] == "completed"
    with pytest.raises(
        ConfigError, match=rf"vocabulary \(16, .*smaller than the data's \({vocab}\)"
    ):
        check_overrides(["model=hf_llama_tiny", *text, "+model.config.vocab_size=16"])
    with pytest.raises(ConfigError, match=r"tokenizer=hf and dataset\.tokenizer_path=DIR"):
        check_overrides(["model=hf_llama_tiny", *text[:3]])


def test_an_image_model_classifies_images(hf_cfg, tmp_path):
    vit = [
        "model=hf",
        "model.name=vit",
        "+model.config.hidden_size=32",
        "+model.config.num_hidden_layers=2",
        "+model.config.num_attention_heads=2",
        "+model.config.intermediate_size=64",
        "+model.config.patch_size=4",
    ]
    cfg = hf_cfg(*vit, "precision=fp32", "dataset.image_size=16", fast=True)
    model = build_workload(cfg, ON_CPU).model
    # The classes and the image size follow the data.
    assert (model.hf.config.num_labels, model.hf.config.image_size) == (10, 16)
    summary = train(cfg, tmp_path)
    assert summary["status"] == "completed" and summary["eval_acc"] is not None


def test_a_text_model_classifies_the_users_token_sequences(hf_cfg, tmp_path):
    bert = [
        "model=hf",
        "model.name=bert",
        "+model.config.hidden_size=32",
        "+model.config.num_hidden_layers=1",
        "+model.config.num_attention_heads=2",
        "+model.config.intermediate_size=64",
        "+model.config.vocab_size=16",
    ]
    data = [
        "dataset=custom",
        "dataset._target_=helpers.user_code.make_token_labels",
        "task=classification",
        "dataset.num_classes=2",
    ]
    summary = train(hf_cfg(*bert, *data, "precision=fp32"), tmp_path)
    assert summary["status"] == "completed" and summary["eval_acc"] is not None


# In the session's shared launch (tests/ddp_jobs.py).
SHARDED_LLAMA = ddp_jobs.declare(
    "hf_llama_fsdp2",
    *FAST_TRAINER,
    "model=hf_llama_tiny",
    *TINY_TOKENS,
    "trainer.strategy=fsdp2",
    "precision=bf16",
)


@pytest.mark.slow
def test_two_ranks_train_the_llama_sharded_under_fsdp2(shared_rank_jobs):
    root, states = shared_rank_jobs
    assert states[SHARDED_LLAMA][1]["summary"]["world_size"] == 2
    summary = json.loads((root / "hf_llama_fsdp2" / "summary.json").read_text())
    assert (summary["status"], summary["strategy"], summary["world_size"]) == (
        "completed",
        "fsdp2",
        2,
    )
    # FSDP2 gathers the fp32 weights and autocasts, as DDP does (precision.fsdp_cast_params).
    assert (summary["param_dtype"], summary["reduce_dtype"]) == ("fp32", "fp32")
    assert summary["flops_per_token"] > 0 and summary["eval_loss"] is not None


def plant_custom_code(folder, config_name: str, auto_map: dict) -> Path:
    """``folder``'s ``config_name`` given an ``auto_map`` that points at a module of the folder
    which, imported, would write the file returned."""
    marker = folder / "custom_code_ran"
    (folder / "planted.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config_file = folder / config_name
    declared = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**declared, "auto_map": auto_map}))
    return marker


def test_a_tokenizer_folder_that_asks_to_run_its_code_is_refused_with_no_prompt(
    tokenizer_dir, tmp_path
):
    """Caught: AutoTokenizer asked to trust the folder's code, which prompts on stdin and, told
    "y", imports planted.py (the red team's case)."""
    folder = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_dir, folder)
    marker = plant_custom_code(
        folder, "tokenizer_config.json", {"AutoTokenizer": ["planted.Tokenizer", None]}
    )
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS)
    overrides = [
        "model=hf_llama_tiny",
        "dataset=text",
        f"dataset.path={corpus}",
        "dataset.tokenizer=hf",
        f"dataset.tokenizer_path={folder}",
    ]
    # "y" on stdin, as a user at the prompt would answer it.
    result = python_m(
        "amp_exp", *overrides, f"hydra.run.dir={tmp_path / 'run'}", input="y\n", timeout=120
    )
    assert result.returncode == 2, result.stderr[-2000:]
    [line] = result.stderr.strip().splitlines()
    assert "tokenizer_config.json asks to run code from the folder (auto_map: planted)" in line
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_a_model_folder_that_asks_to_run_its_code_is_refused(saved_llama, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(saved_llama, folder)
    marker = plant_custom_code(
        folder,
        "config.json",
        {"AutoConfig": "planted.Config", "AutoModelForCausalLM": "someone/repo--planted.Model"},
    )
    with pytest.raises(ConfigError, match=r"config\.json asks to run code .*auto_map: planted\)"):
        check_overrides(["model=hf", f"model.path={folder}", "dataset=synthetic_tokens"])
    assert not marker.exists()
