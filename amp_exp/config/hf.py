"""Hugging Face transformers, checked before anything is built: the library, the model type or
local folder, the config keys, the auto class the task needs, and a local tokenizer.

``model=hf`` names a model type (``model.name=llama``), built from that type's default config
with random weights, or a local ``save_pretrained`` folder (``model.path=DIR``) with its weights.
Nothing is ever downloaded and no code from a folder ever runs: every ``from_pretrained`` passes
``local_files_only=True`` and ``trust_remote_code=False``, and a folder whose config asks for its
own code (an ``auto_map``) is refused before transformers is imported, so the library never
prompts for permission on stdin. transformers is an optional extra, imported here only when a run
asks for it (it imports torch).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from amp_exp.config.models import HFModelConfig
from amp_exp.config.schema import TaskName
from amp_exp.errors import ConfigError, first_line

# The oldest release whose API this module and tasks/hf.py use was read for (4.46.0's source:
# AutoConfig.for_model, the auto classes' *_MAPPING_NAMES, from_config(attn_implementation=),
# _no_split_modules, _keep_in_fp32_modules, get_text_config). pyproject's hf extra says the same.
MIN_TRANSFORMERS = "4.46"
INSTALL = "pip install 'amp_exp[hf]'"
# What every from_pretrained of a user's folder passes: read only what is on disk, run none of it.
FOLDER_ONLY = {"local_files_only": True, "trust_remote_code": False}
# The files in which a save_pretrained folder can ask for code of its own (an ``auto_map`` of
# auto class to ``module.Class`` in the folder): the model's, the tokenizer's, a processor's.
CODE_REQUESTS = (
    "config.json",
    "tokenizer_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "feature_extractor_config.json",
    "image_processor_config.json",
)
# Named first when a model type is unknown: the ones people train most.
COMMON_TYPES = ("gpt2", "llama", "mistral", "qwen2", "gemma", "phi3", "bert", "vit")
# Config attributes that size or count something, by transformers' common names (a type's
# attribute_map adds its own, such as GPT-2's n_layer). transformers takes 0 or -1 for them and
# builds a model without layers, or one whose FLOP count is negative.
SIZE_KEYS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "n_inner",
        "num_channels",
        "image_size",
        "patch_size",
        "embedding_size",
    }
)
# The auto class each kind of data needs (tokens, labelled images, labelled sequences): the name
# of its mapping in transformers, its class.
AUTO_CLASSES = {
    "tokens": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
    "images": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification"),
    "sequences": (
        "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
        "AutoModelForSequenceClassification",
    ),
}


def require_transformers(why: str = "model=hf") -> None:
    """transformers is installed and at least MIN_TRANSFORMERS, or one line with the command."""
    try:
        found = version("transformers")
    except PackageNotFoundError:
        raise ConfigError(f"{why} needs transformers, which is not installed: {INSTALL}") from None
    from packaging.version import Version  # a dependency of transformers itself

    if Version(found) < Version(MIN_TRANSFORMERS):
        raise ConfigError(
            f"{why} needs transformers>={MIN_TRANSFORMERS}, found {found}: {INSTALL} --upgrade"
        )


@functools.cache
def model_types() -> tuple[str, ...]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return tuple(CONFIG_MAPPING_NAMES)


def _types_hint(name: str, types: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name, types, n=3, cutoff=0.75)
    common = [t for t in COMMON_TYPES if t in types and t not in close]
    return ", ".join([*close, *common])


def refuse_custom_code(folder: Path, option: str) -> None:
    """Refuse a folder that asks transformers to import Python code from it (``auto_map``)."""
    for name in CODE_REQUESTS:
        try:
            declared = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue  # absent or unreadable: transformers reports what it needs
        if isinstance(declared, dict) and declared.get("auto_map"):
            modules = sorted({str(v).split(".")[0] for v in _code_references(declared)})
            raise ConfigError(
                f"{option}={folder}: its {name} asks to run code from the folder "
                f"(auto_map: {', '.join(modules) or 'custom classes'}), which amp_exp never "
                "does; use a folder saved from a model or tokenizer class built into transformers"
            )


def _code_references(declared: dict[str, Any]) -> list[str]:
    """The ``module.Class`` names an ``auto_map`` points to (a name, or a [slow, fast] pair)."""
    auto_map = declared["auto_map"]
    found = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
    names = []
    for value in found:
        names.extend(v for v in (value if isinstance(value, list) else [value]) if v)
    return [name.rsplit("--", 1)[-1] for name in names]  # "repo--module.Class" names a Hub repo


def saved_model_type(path: Path) -> str:
    """The model type a save_pretrained folder holds, from its config.json."""
    if not path.is_dir():
        raise ConfigError(f"model.path={path}: no such directory")
    refuse_custom_code(path, "model.path")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(
            f"model.path={path}: no config.json there; model.path needs a folder written by "
            "save_pretrained"
        )
    try:
        model_type = json.loads(config_file.read_text())["model_type"]
    except (ValueError, KeyError) as error:
        raise ConfigError(f"model.path={path}: config.json names no model_type ({error})") from None
    return str(model_type)


def check_model(model: HFModelConfig) -> None:
    """The library, the model type (or folder) and each ``model.config`` key; fills in
    ``model.name`` from the folder when only ``model.path`` is given."""
    require_transformers()
    if model.path is not None:
        found = saved_model_type(Path(model.path).expanduser())
        if model.name not in (None, found):
            raise ConfigError(
                f"model.name={model.name} but model.path={model.path} holds a {found} model; "
                "leave model.name out with model.path"
            )
        model.name = found
    if model.name is None:
        raise ConfigError(
            "model=hf needs model.name=TYPE (e.g. llama, gpt2) or model.path=DIR (a "
            "save_pretrained folder)"
        )
    types = model_types()
    if model.name not in types:
        raise ConfigError(
            f"model.name={model.name!r} is not a transformers model type; valid types include "
            f"{_types_hint(model.name, types)} ({len(types)} in all: AutoConfig.for_model)"
        )
    known = config_keys(model.name)
    for key in model.config:
        if key not in known:
            hint = ", ".join(difflib.get_close_matches(key, known, n=3)) or "none close"
            raise ConfigError(
                f"model.config.{key} is not an attribute of the {model.name} config; close "
                f"ones: {hint}"
            )
    _check_sizes(model)


def size_keys(model_type: str) -> frozenset[str]:
    """SIZE_KEYS, and what the type's config calls them (GPT-2's n_layer, n_head, n_embd)."""
    aliases = getattr(type(default_config(model_type)), "attribute_map", {})
    return SIZE_KEYS | {own for common, own in aliases.items() if common in SIZE_KEYS}


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_sizes(model: HFModelConfig) -> None:
    """Sizes, layer counts and head counts are integers of 1 or more: each one ``model.config``
    sets, and, for a folder, each its config.json sets (null leaves the type's default)."""
    sized = size_keys(model.name)
    for key, value in model.config.items():
        if key in sized and value is not None and not _is_size(value):
            raise ConfigError(
                f"model.config.{key}={value} must be an integer of 1 or more (a size, layer or "
                "head count)"
            )
    if model.path is None:
        return
    saved = model_config(model).get_text_config()
    default = default_config(model.name).get_text_config()
    for key in sorted(SIZE_KEYS):
        value = getattr(saved, key, None)
        # The type's own default may be a marker (XLNet's max_position_embeddings=-1: no limit).
        if value is not None and value != getattr(default, key, None) and not _is_size(value):
            raise ConfigError(
                f"model.path={model.path}: its config sets {key}={value}, which must be an "
                "integer of 1 or more (a size, layer or head count)"
            )


@functools.cache
def default_config(model_type: str):
    """The model type's default transformers config; read it, never change it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]()


@functools.cache
def config_keys(model_type: str) -> frozenset[str]:
    """What a model type's config takes: its attributes (aliases such as GPT-2's n_layer for
    num_hidden_layers included) and its constructor's arguments."""
    default = default_config(model_type)
    config_class = type(default)
    return frozenset(
        [
            *vars(default),
            *getattr(config_class, "attribute_map", {}),
            *inspect.signature(config_class.__init__).parameters,
        ]
    )


def check_auto_class(model: HFModelConfig, task: TaskName, images: bool) -> None:
    """The model type has the auto class its data needs: causal LM for tokens, image or
    sequence classification for labels."""
    import transformers.models.auto.modeling_auto as modeling_auto

    kind = "tokens" if task is TaskName.lm else "images" if images else "sequences"
    mapping_name, auto_class = AUTO_CLASSES[kind]
    mapping = getattr(modeling_auto, mapping_name)
    if model.name not in mapping:
        raise ConfigError(
            f"model.name={model.name} has no {auto_class} in transformers, which "
            f"task={task.value} on this data needs; types that have one include "
            f"{_types_hint(model.name, tuple(mapping))}"
        )


def causal_variant(model: HFModelConfig) -> str:
    """Why a model built by its type's causal-LM auto class saw later tokens, and whether the
    type has a variant that does not: MODEL_FOR_CAUSAL_LM_MAPPING_NAMES's class (which
    check_auto_class made sure it has) masks later tokens in a BERT-like encoder only as a
    decoder."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model.name]
    if getattr(model_config(model).get_text_config(), "is_decoder", None) is False:
        return (
            f"the {model.name} type is an encoder; its causal variant, {causal}, masks later "
            "tokens only with +model.config.is_decoder=true"
        )
    return (
        f"{causal}, the {model.name} type's causal-LM class, sees later tokens even so; use a "
        "decoder type such as gpt2 or llama"
    )


def model_config(model: HFModelConfig, **defaults: Any):
    """The model's transformers config: the type's default, or the folder's, with
    ``model.config`` set on top. ``defaults`` (what the data says: vocabulary, classes, image
    size) apply where ``model.config`` does not set the key, and only to a model built from
    its type: a saved model's shapes are its weights'."""
    from transformers import AutoConfig

    overrides = dict(model.config)
    if model.path is None:
        return AutoConfig.for_model(model.name, **{**defaults, **overrides})
    return AutoConfig.from_pretrained(Path(model.path).expanduser(), **FOLDER_ONLY, **overrides)


def max_positions(model: HFModelConfig) -> int | None:
    """The longest sequence the model's position table or RoPE setting is made for."""
    return getattr(model_config(model).get_text_config(), "max_position_embeddings", None)


# The sequence length of a model=hf run that gives no dataset.seq_len: the model's
# max_position_embeddings up to this. Qwen2's 32,768 positions at the default batch of 32 asked
# a CPU for 16 GiB of attention scores in one forward pass.
DEFAULT_SEQ_LEN = 1024


def default_seq_len(model: HFModelConfig) -> int | None:
    """The sequence length a run takes when dataset.seq_len is null: ``DEFAULT_SEQ_LEN`` at most."""
    positions = max_positions(model)
    return None if positions is None else min(positions, DEFAULT_SEQ_LEN)


def model_vocab_size(model: HFModelConfig) -> int | None:
    """The vocabulary the model is fixed to, or None where it takes the data's: a model built
    from its type without ``model.config.vocab_size``."""
    if model.path is None and "vocab_size" not in model.config:
        return None
    return model_config(model).get_text_config().vocab_size


@functools.cache
def load_tokenizer(path: str):
    """A local tokenizer folder, through AutoTokenizer, never downloading."""
    require_transformers("dataset.tokenizer=hf")
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"dataset.tokenizer_path={path}: no such directory; it needs a tokenizer folder "
            "written by save_pretrained"
        )
    refuse_custom_code(folder, "dataset.tokenizer_path")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, **FOLDER_ONLY)
    except Exception as error:
        raise ConfigError(
            f"dataset.tokenizer_path={path}: AutoTokenizer cannot load it "
            f"({type(error).__name__}: {first_line(str(error))})"
        ) from None


def tokenizer_vocab_size(path: str) -> int:
    """Every id the tokenizer can produce, added tokens included, lies below this."""
    return len(load_tokenizer(path))
