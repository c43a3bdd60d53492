"""Token data for language models: a synthetic Markov chain, or text files; both on the device.

A split is one token stream cut into windows of seq_len + 1 tokens that overlap by one, so every
token but the first is a target exactly once. The windows are views of the stream: the inputs
are ``windows[:, :-1]``, the targets ``windows[:, 1:]``, and no token is stored twice. Batches
come from ``DeviceTensorLoader``, so every epoch's order depends only on (seed, epoch) and a
resumed run continues mid-epoch exactly.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from amp_exp.config import hf
from amp_exp.config.cross_checks import text_vocab_size
from amp_exp.config.datasets import SyntheticTokensConfig, TextDatasetConfig, Tokenizer
from amp_exp.errors import ConfigError, first_line
from amp_exp.runtime.atomic import atomic_write
from amp_exp.tasks.base import DataBundle
from amp_exp.tasks.sampling import DeviceTensorLoader, Placement, tensor_loaders

GPT2_END_OF_TEXT = 50256
# Bumped whenever the cached token format changes, so stale caches are never read.
CACHE_VERSION = 1
CACHE_DIRNAME = ".amp_exp_tokens"
# What tokenize writes: uint16, or uint32 for a vocabulary over 65,536 (a Hugging Face tokenizer).
TOKEN_DTYPES = (np.uint16, np.uint32)

log = logging.getLogger("amp_exp")


def token_facts(vocab_size: int, seq_len: int) -> dict:
    return {"vocab_size": vocab_size, "seq_len": seq_len}


def token_loaders(
    train_windows: torch.Tensor,
    eval_windows: torch.Tensor,
    cfg: SyntheticTokensConfig | TextDatasetConfig,
    placement: Placement,
) -> tuple[DeviceTensorLoader, DeviceTensorLoader]:
    """Inputs and targets as views of each window, one token apart."""
    train, held_out = ((w[:, :-1], w[:, 1:]) for w in (train_windows, eval_windows))
    count = f"the {len(train_windows)} training sequences"
    return tensor_loaders(train, held_out, cfg.batch_size, cfg.eval_batch_size, placement, count)


# --- synthetic: a sparse random Markov chain -------------------------------------------------


def markov_chain(vocab_size: int, branching: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``branching`` successors [V, k] and their probabilities [V, k] (float64).

    Successors are drawn with replacement; a repeated one simply holds the sum of its slots'
    probabilities. The probabilities are Dirichlet(1) draws.
    """
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(vocab_size, (vocab_size, branching), generator=generator)
    weights = -torch.rand(vocab_size, branching, generator=generator, dtype=torch.float64).log()
    return successors, weights / weights.sum(dim=1, keepdim=True)


def entropy_floor(successors: torch.Tensor, probs: torch.Tensor, seq_len: int) -> float:
    """The expected loss per target of the best possible model: the true chain itself.

    Sequences start from a uniform token, so position t's token follows p_t = p_0 P^t; the target
    at t + 1 then costs H(row) nats on average, summed over where the chain stands.
    """
    vocab_size = successors.shape[0]
    # The mass of each slot's token in its row, duplicates merged: sum_j w_j log m(id_j) is then
    # sum over distinct ids u of m_u log m_u.
    same = successors.unsqueeze(2) == successors.unsqueeze(1)
    merged = (same * probs.unsqueeze(1)).sum(dim=2)
    row_entropy = -(probs * merged.log()).sum(dim=1)
    marginal = torch.full((vocab_size,), 1 / vocab_size, dtype=torch.float64)
    total = 0.0
    for _ in range(seq_len):
        total += float(marginal @ row_entropy)
        moved = (marginal.unsqueeze(1) * probs).flatten()
        marginal = torch.zeros_like(marginal).scatter_add_(0, successors.flatten(), moved)
    return total / seq_len


def sample_chain(
    successors: torch.Tensor, probs: torch.Tensor, count: int, length: int, seed: int
) -> torch.Tensor:
    """``count`` sequences of ``length`` tokens [count, length], int32."""
    generator = torch.Generator().manual_seed(seed)
    vocab_size, branching = successors.shape
    cumulative = probs.cumsum(dim=1)
    uniform = torch.rand(count, length, generator=generator, dtype=torch.float64)
    tokens = torch.empty(count, length, dtype=torch.int64)
    tokens[:, 0] = torch.randint(vocab_size, (count,), generator=generator)
    for t in range(1, length):
        current = tokens[:, t - 1]
        slot = (cumulative[current] < uniform[:, t : t + 1]).sum(dim=1).clamp_(max=branching - 1)
        tokens[:, t] = successors[current, slot]
    return tokens.to(torch.int32)


def build_synthetic_tokens(
    cfg: SyntheticTokensConfig, seq_len: int, placement: Placement
) -> DataBundle:
    """The chain depends only on the placement's seed; the train split (0) and the eval split
    (1) are different samples of it."""
    seed = placement.seed
    successors, probs = markov_chain(cfg.vocab_size, cfg.branching, seed)
    splits = [
        sample_chain(successors, probs, size, seq_len + 1, seed * 1_000_003 + 1 + split).to(
            placement.device
        )
        for split, size in enumerate((cfg.train_size, cfg.eval_size))
    ]
    train, held_out = token_loaders(*splits, cfg, placement)
    floor = entropy_floor(successors, probs, seq_len)
    return DataBundle(
        train, held_out, token_facts(cfg.vocab_size, seq_len), recorded={"loss_floor": floor}
    )


# --- text files ----------------------------------------------------------------------------


def text_files(path: Path) -> list[Path]:
    """The file itself, or a folder's .txt files in a fixed (sorted) order."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*.txt") if p.is_file())
    if not files:
        raise ConfigError(f"dataset.path={path} holds no .txt files")
    return files


def tiktoken_cache_dir() -> Path | None:
    """Where tiktoken keeps downloaded files (tiktoken/load.py); None when caching is off."""
    for variable in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if variable in os.environ:
            return Path(os.environ[variable]) if os.environ[variable] else None
    return Path(tempfile.gettempdir()) / "data-gym-cache"


# tiktoken's GPT-2 encoding reads these two files, cached under the SHA-1 of their URL.
GPT2_FILES = tuple(
    f"https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/{name}"
    for name in ("vocab.bpe", "encoder.json")
)


def gpt2_encoding():
    """tiktoken's GPT-2 encoding, only from files already cached: it never downloads."""
    try:
        import tiktoken
    except ImportError:
        raise ConfigError(
            "dataset.tokenizer=gpt2 needs tiktoken: pip install 'amp_exp[text]'"
        ) from None
    cache = tiktoken_cache_dir()
    if cache is None or not all(
        (cache / hashlib.sha1(url.encode()).hexdigest()).is_file() for url in GPT2_FILES
    ):
        raise ConfigError(
            f"dataset.tokenizer=gpt2: tiktoken's GPT-2 files are not cached in {cache}; on a "
            "machine with network run python -c \"import tiktoken; tiktoken.get_encoding('gpt2')\""
            " with TIKTOKEN_CACHE_DIR set, copy that folder here and point TIKTOKEN_CACHE_DIR at "
            "it (or use dataset.tokenizer=bytes)"
        )
    return tiktoken.get_encoding("gpt2")


def tokenize(files: list[Path], cfg: TextDatasetConfig) -> np.ndarray:
    """The files' tokens as one stream (uint16, or uint32 for a vocabulary over 65,536); GPT-2
    and a Hugging Face tokenizer with an end-of-text token separate files with it."""
    if cfg.tokenizer is Tokenizer.bytes:
        return np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8).astype(
            np.uint16
        )
    if cfg.tokenizer is Tokenizer.gpt2:
        encoding = gpt2_encoding()
        encode, separator = encoding.encode_ordinary, GPT2_END_OF_TEXT
    else:
        tokenizer = hf.load_tokenizer(cfg.tokenizer_path)
        separator = tokenizer.eos_token_id

        def encode(text: str) -> list[int]:
            # verbose=False: a whole file is longer than the model's context, on purpose.
            return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

    stream: list[int] = []
    for file in files:
        stream += encode(file.read_text(encoding="utf-8", errors="replace"))
        if separator is not None:
            stream.append(separator)
    dtype = np.uint16 if text_vocab_size(cfg) <= 2**16 else np.uint32
    return np.asarray(stream, dtype=dtype)


def cache_name(path: Path, files: list[Path], cfg: TextDatasetConfig) -> str:
    """Changes whenever a file is added, removed, resized or touched, or the tokenizer (or a
    file of its folder) changes."""
    digest = hashlib.sha1(f"v{CACHE_VERSION} {cfg.tokenizer.value}".encode())
    named = [(file, file.relative_to(path.parent)) for file in files]
    if cfg.tokenizer is Tokenizer.hf:
        folder = Path(cfg.tokenizer_path).expanduser().resolve()
        named += [(file, file) for file in sorted(folder.iterdir()) if file.is_file()]
    for file, name in named:
        stat = file.stat()
        digest.update(f"{name} {stat.st_size} {stat.st_mtime_ns}".encode())
    return f"{path.name}.{cfg.tokenizer.value}.{digest.hexdigest()[:16]}.npy"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "amp_exp" / "tokens"


def read_cache(path: Path) -> np.ndarray | None:
    """The tokens cached in ``path``, or None for a cache that cannot be read (a truncated or
    foreign file): it is removed, said once, and built again."""
    try:
        tokens = np.load(path)
        if tokens.dtype not in TOKEN_DTYPES or tokens.ndim != 1:
            raise ValueError(f"it holds {tokens.dtype} of shape {tokens.shape}, not a token stream")
    except (OSError, ValueError, EOFError) as error:
        log.warning("token cache %s is unreadable (%s); tokenizing again", path, describe(error))
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    return tokens


def save_cache(tokens: np.ndarray, paths: tuple[Path, ...]) -> None:
    """Cache ``tokens`` in the first of ``paths`` that takes them. Ranks, or runs of a sweep, that
    tokenize at once each write a temporary file of their own, and the rename makes one of them
    the cache, never a mix; a failed write leaves no partial file. The tokens are in memory
    already, so a disk that takes none of them costs a warning, not the run."""
    for path in paths:
        try:
            atomic_write(path, lambda file: np.save(file, tokens), durable=False)
            return
        except OSError as error:
            refused = error
    log.warning(
        "could not cache the tokens in %s (%s); training on them all the same, and tokenizing "
        "again next time",
        " or ".join(str(path.parent) for path in paths),
        describe(refused),
    )


def describe(error: Exception) -> str:
    return getattr(error, "strerror", None) or first_line(str(error)) or type(error).__name__


def load_text_tokens(cfg: TextDatasetConfig) -> np.ndarray:
    """The tokens of ``cfg.path``: tokenized once, then read from the cache next to the data
    (or in ``cfg.cache_dir`` when that folder cannot be written)."""
    path = Path(cfg.path).expanduser().resolve()
    files = text_files(path)
    name = cache_name(path, files, cfg)
    beside = (path if path.is_dir() else path.parent) / CACHE_DIRNAME / name
    elsewhere = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    for candidate in (beside, elsewhere / name):
        if candidate.is_file() and (cached := read_cache(candidate)) is not None:
            return cached
    tokens = tokenize(files, cfg)
    save_cache(tokens, (beside, elsewhere / name))
    return tokens


def windows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[count, seq_len + 1] views of a stream, each starting where the last one's inputs end."""
    count = (len(tokens) - 1) // seq_len
    return tokens[: count * seq_len + 1].unfold(0, seq_len + 1, seq_len)


def build_text(cfg: TextDatasetConfig, seq_len: int, placement: Placement) -> DataBundle:
    """The last ``eval_fraction`` of the stream is the eval split, the rest trains."""
    tokens = torch.from_numpy(load_text_tokens(cfg).astype(np.int32))
    eval_count = math.ceil(len(tokens) * cfg.eval_fraction)
    splits = tokens[: len(tokens) - eval_count], tokens[len(tokens) - eval_count :]
    for described, split in zip(("training", "eval"), splits, strict=True):
        if len(split) <= seq_len:
            raise ConfigError(
                f"dataset.path={cfg.path}: its {described} split holds {len(split)} tokens, too "
                f"few for one sequence of {seq_len} (dataset.seq_len, dataset.eval_fraction)"
            )
    train, held_out = token_loaders(
        *(windows(split.to(placement.device), seq_len) for split in splits), cfg, placement
    )
    return DataBundle(train, held_out, token_facts(text_vocab_size(cfg), seq_len))
