"""Hugging Face transformers models, as the tasks train them: inputs in, a tensor of logits out.

``HFModel`` holds the transformers model as its submodule ``hf``, so every module and parameter
keeps the name transformers gives it, under the one prefix ``hf.``: ``hf.model.layers.0.self_attn
.q_proj`` in a Llama, ``hf.transformer.h.0.attn.c_attn`` in GPT-2. fp8's choice of layers, the
precision audit, the sensitivity command and checkpoints all see these names; without the prefix
they are the keys of the model's own ``save_pretrained``. The forward hands the ``ModelOutput``'s
logits to the task, which computes the loss from them in fp32, as for every other model.

The repeated layers the model names in ``_no_split_modules`` (``LlamaDecoderLayer``,
``GPT2Block``) are its blocks (tasks/blocks.py): each is recomputed, compiled and sharded on
its own, as a GPT's. Under bf16_true, normalization layers and rotary embeddings keep fp32
weights, buffers and arithmetic (``keep_in_fp32``), as the precision keeps nn.LayerNorm.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from amp_exp.config import hf
from amp_exp.config.models import HFModelConfig
from amp_exp.config.schema import TaskName
from amp_exp.errors import ConfigError, first_line
from amp_exp.tasks.flops import decoder_flops_per_token, matmul_parameters

# transformers names every norm and rotary embedding class this way (LlamaRMSNorm, ...).
FP32_CLASS_SUFFIXES = ("RMSNorm", "LayerNorm", "RotaryEmbedding")


class HFModel(nn.Module):
    """A transformers model under ``hf``: its inputs by keyword, its logits out."""

    def __init__(self, model: nn.Module, input_name: str, **call_kwargs: Any) -> None:
        super().__init__()
        self.hf = model
        self.input_name = input_name
        self.call_kwargs = call_kwargs
        # The modules transformers itself keeps in fp32 when it loads a model in half precision.
        kept = set(getattr(model, "_keep_in_fp32_modules", None) or ())
        for name, module in model.named_modules():
            if type(module).__name__.endswith(FP32_CLASS_SUFFIXES) or kept & set(name.split(".")):
                module.keep_in_fp32 = True

    def forward(self, inputs: torch.Tensor | None = None, **named: torch.Tensor) -> torch.Tensor:
        """One tensor of inputs, or the dict of a transformers batch by keyword
        (``input_ids``, ``attention_mask``, ...)."""
        if inputs is not None:
            named[self.input_name] = inputs
        return self.hf(**named, **self.call_kwargs).logits


def build_hf_model(cfg: HFModelConfig, task: TaskName, facts: dict[str, Any]) -> HFModel:
    """The auto class the data needs, built from the config (random weights) or loaded from
    ``cfg.path``; what the data says (vocabulary, classes, image size) fills the config where
    ``model.config`` does not set it."""
    import transformers

    if task is TaskName.lm:
        # No key/value cache: training never generates, and a cache would hold every layer's K/V.
        kind, input_name, call_kwargs = "CausalLM", "input_ids", {"use_cache": False}
        data = {"vocab_size": facts["vocab_size"], **special_tokens_outside(cfg, facts)}
    elif len(facts["input_shape"]) == 3:
        channels, size, _ = facts["input_shape"]
        kind, input_name, call_kwargs = "ImageClassification", "pixel_values", {}
        data = {"num_channels": channels, "image_size": size}
    else:
        kind, input_name, call_kwargs = "SequenceClassification", "input_ids", {}
        data = {}
    # Only what this type's config has: a ResNet's has no image size, say.
    known = hf.config_keys(cfg.name)
    config = hf.model_config(cfg, **{key: v for key, v in data.items() if key in known})
    if task is TaskName.classification:
        config.num_labels = facts["num_classes"]  # a saved model's head too: it must fit
    auto = getattr(transformers, f"AutoModelFor{kind}")
    attention = {"attn_implementation": cfg.attn_implementation.value}
    where = f"model.path={cfg.path}" if cfg.path else f"model.name={cfg.name}"
    # Its progress bar for loading a few local files would only clutter the run's log.
    transformers.utils.logging.disable_progress_bar()
    # On the meta device (predict's trace) there is no storage to load weights into: a folder's
    # config alone builds the model (transformers refuses from_pretrained there).
    weightless = torch.get_default_device().type == "meta"
    try:
        if cfg.path is None or weightless:
            model = auto.from_config(config, **attention)
        else:
            model = auto.from_pretrained(cfg.path, config=config, **hf.FOLDER_ONLY, **attention)
    except Exception as error:
        raise ConfigError(
            f"model=hf {where}: {auto.__name__} cannot build it: {type(error).__name__}: "
            f"{first_line(str(error))}"
        ) from None
    finally:
        transformers.utils.logging.enable_progress_bar()
    # fp32 master weights, whatever dtype a folder was saved in: the precision casts from there.
    return HFModel(model.float(), input_name, **call_kwargs)


def special_tokens_outside(cfg: HFModelConfig, facts: dict[str, Any]) -> dict[str, None]:
    """The default config's special token ids (GPT-2's 50256) that lie outside the data's
    vocabulary, unset: only generation reads them, and transformers warns about each."""
    default = hf.default_config(cfg.name)
    vocab_size = cfg.config.get("vocab_size", facts["vocab_size"])
    return {
        key: None
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if isinstance(getattr(default, key, None), int)
        and getattr(default, key) >= vocab_size
        and key not in cfg.config
    }


def hf_flops_per_token(model: HFModel, seq_len: int) -> float:
    """6N + 12·L·H·Q·T (tasks/flops.py) with L, H and Q from the model's config: Q is its
    ``head_dim`` where it sets one (Gemma's is not hidden_size / heads)."""
    config = model.hf.config.get_text_config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return decoder_flops_per_token(
        matmul_parameters(model), config.num_hidden_layers, heads, head_dim, seq_len
    )
