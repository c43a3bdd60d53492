"""Model schemas: one dataclass per family of model, registered in ``SCHEMAS["model"]``.

Image models (ours, torchvision's, timm's), GPT language models, Hugging Face transformers models
and the user's own model each have a dataclass. A leaf like config/schema.py: it imports nothing
from amp_exp.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional, Union

from omegaconf import MISSING


@dataclass
class TinyCNNConfig:
    """Two 3x3 convolutions, global average pooling and a linear head."""

    name: str = "tiny_cnn"
    width: int = field(default=32, metadata={"bound": "positive_integer"})
    # L2-normalize the pooled features with a custom autograd function that runs in fp32.
    normalize_features: bool = False


@dataclass
class MLPConfig:
    """Flattened input, ``depth`` hidden layers of ``hidden_dim`` units."""

    name: str = "mlp"
    hidden_dim: int = field(default=256, metadata={"bound": "positive_integer"})
    depth: int = field(default=2, metadata={"bound": "at_least_0"})


@dataclass
class TorchvisionModelConfig:
    """Any torchvision classification model by name, built with random weights."""

    name: str = MISSING


@dataclass
class GPTConfig:
    """A decoder-only transformer (tasks/gpt.py): pre-LayerNorm blocks, causal attention, a GELU
    MLP, and an output head tied to the token embedding."""

    name: str = "gpt"
    n_layer: int = field(default=12, metadata={"bound": "positive"})
    n_head: int = field(default=12, metadata={"bound": "positive"})
    d_model: int = field(default=768, metadata={"bound": "positive"})
    # The longest context: the size of the position table. Token data is cut into windows of
    # dataset.seq_len tokens, which defaults to this.
    seq_len: int = field(default=1024, metadata={"bound": "positive"})
    # null = the dataset's vocabulary; a larger value pads the output head (e.g. 50304).
    vocab_size: int | None = None
    dropout: float = field(default=0.0, metadata={"bound": "half_open_unit"})
    # Biases in the linear layers and LayerNorms, as GPT-2 has them.
    bias: bool = True


@dataclass
class TimmModelConfig:
    """Any timm model by name (optional extra: pip install 'amp_exp[timm]'), random weights."""

    name: str = MISSING
    # Passed to timm.create_model, e.g. +model.kwargs.img_size=32 for a ViT on small images.
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class CustomModelConfig:
    """The user's own model: ``_target_`` names a callable that returns an nn.Module.

    It is called with ``kwargs`` plus those of the dataset's facts its signature accepts:
    num_classes and input_shape for images; vocab_size and seq_len for tokens.
    """

    name: str = "custom"
    _target_: str = MISSING
    kwargs: dict[str, Any] = field(default_factory=dict)


class AttnImplementation(str, Enum):
    # A Hugging Face model's attention: torch's fused kernel (sdpa) or its own matmuls (eager).
    sdpa = "sdpa"
    eager = "eager"


@dataclass
class HFModelConfig:
    """A Hugging Face transformers model (pip install 'amp_exp[hf]') through the auto class its
    data needs: causal LM for tokens, image or sequence classification for labels (tasks/hf.py)."""

    # A model type AutoConfig.for_model knows (gpt2, llama, vit, ...): random weights.
    name: str | None = None
    # A local save_pretrained folder: its config and weights (local_files_only); sets name.
    path: str | None = None
    # Config attributes set on top (+model.config.num_hidden_layers=2). Built from a type, the
    # vocabulary, classes and image size follow the data unless set here.
    config: dict[str, Optional[Union[int, float, bool, str]]] = field(default_factory=dict)
    attn_implementation: AttnImplementation = AttnImplementation.sdpa


ModelConfig = Union[
    TinyCNNConfig,
    MLPConfig,
    TorchvisionModelConfig,
    GPTConfig,
    TimmModelConfig,
    CustomModelConfig,
    HFModelConfig,
]
