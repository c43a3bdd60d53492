"""A user's own models and data, as they would write them: tests import them by _target_."""

from __future__ import annotations

import math
import os
import signal
from collections import OrderedDict

import torch
from torch import nn
from torch.utils.data import TensorDataset


def make_classifier(input_shape: tuple[int, ...], num_classes: int, hidden: int = 16) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), hidden),
        nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


def make_classifier_met_by(
    input_shape: tuple[int, ...], num_classes: int, rendezvous: str, jobs: int
) -> nn.Module:
    """make_classifier's model, built only once ``jobs`` jobs are building theirs at the same
    time: each leaves its pid in ``rendezvous`` and waits (at most 60 s) for the others'. Jobs
    run one after another never meet, so the first fails: parallelism proved without a clock."""
    import time
    from pathlib import Path

    folder = Path(rendezvous)
    (folder / str(os.getpid())).touch()
    deadline = time.monotonic() + 60
    while len(list(folder.iterdir())) < jobs:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {jobs} jobs met in {folder} within 60 s")
        time.sleep(0.05)
    return make_classifier(input_shape, num_classes)


class TinyLM(nn.Module):
    """An embedding and a linear head: enough to learn which token follows which."""

    def __init__(self, vocab_size: int, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


def make_lm(vocab_size: int, width: int = 16) -> nn.Module:
    return TinyLM(vocab_size, width)


class Encoder(TinyLM):
    """TinyLM that adds the sequence's mean embedding at every position: like BERT's attention,
    each position sees every later token."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.head(x + x.mean(dim=1, keepdim=True))


def make_encoder(vocab_size: int) -> nn.Module:
    return Encoder(vocab_size)


class Peeking(TinyLM):
    """TinyLM whose one position ``at`` (negative: from the end) also sees the next token: a
    leak between two neighbours only, which a cut between them alone finds."""

    def __init__(self, vocab_size: int, at: int) -> None:
        super().__init__(vocab_size)
        self.at = at

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        peek = torch.zeros_like(x)
        peek[:, self.at] = x[:, self.at + 1]
        return self.head(x + peek)


def make_peeking(vocab_size: int, at: int) -> nn.Module:
    return Peeking(vocab_size, at)


class TrainingOnly(TinyLM):
    """TinyLM that refuses to run in eval mode."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if not self.training:
            raise RuntimeError("only trains")
        return super().forward(tokens)


def make_training_only(vocab_size: int) -> nn.Module:
    return TrainingOnly(vocab_size)


def make_anything(**facts) -> nn.Module:
    """Takes every fact offered; remembers them for the test to read."""
    model = nn.LazyLinear(facts.get("num_classes", 1))
    model.facts = facts
    return nn.Sequential(nn.Flatten(), model)


def make_wrong_width(num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes + 1))


def make_labelled_vectors(seed: int, size: int = 96, classes: int = 3):
    """(train, eval) of 8-dimensional points whose class is the sign pattern of their mean."""
    generator = torch.Generator().manual_seed(seed)
    splits = []
    for count in (size, size // 2):
        labels = torch.randint(classes, (count,), generator=generator)
        points = torch.randn(count, 8, generator=generator) + 2.0 * labels[:, None]
        splits.append(TensorDataset(points, labels))
    return tuple(splits)


def make_counting(vocab_size: int = 11, seq_len: int = 8, size: int = 64):
    """(train, eval) of sequences that count up modulo vocab_size: target = input + 1."""
    starts = torch.arange(size) % vocab_size
    inputs = (starts[:, None] + torch.arange(seq_len)) % vocab_size
    dataset = TensorDataset(inputs, (inputs + 1) % vocab_size)
    return dataset, dataset


class PlantedOverflow(nn.Module):
    """A classifier with one layer planted to break fp16, and one that bf16 breaks.

    ``big`` multiplies its input by weights so large that its activations reach about 1e5, beyond
    fp16's 65504; the LayerNorm after it brings them back to 1, so in fp32 or bf16 (fp32's range)
    the model trains. ``offset`` has weights near 1 whose small differences carry the signal:
    bf16's 8 significant bits round most of them away, fp16's 11 fewer of them.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 16) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.big = nn.Linear(math.prod(input_shape), width)
        self.norm = nn.LayerNorm(width, elementwise_affine=False)
        self.offset = nn.Linear(width, width)
        self.act = nn.ReLU()
        self.head = nn.Linear(width, num_classes)
        with torch.no_grad():
            self.big.weight.mul_(3e5)
            self.offset.weight.mul_(0.05).add_(1.0)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.offset(self.norm(self.big(self.flatten(images))))))


def make_planted_overflow(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return PlantedOverflow(input_shape, num_classes)


class OverflowingLinear(nn.Module):
    """A small MLP whose one narrow Linear, ``blowup``, breaks fp16: its weights are so large
    that its activations reach about 1e5, beyond fp16's 65504, and the LayerNorm after it brings
    them back to 1. ``trunk`` before it holds most of the FLOPs, so keeping ``blowup`` alone in
    fp32 leaves most of the model in fp16."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 32) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.trunk = nn.Linear(math.prod(input_shape), width)
        self.act = nn.ReLU()
        self.blowup = nn.Linear(width, 8)
        self.norm = nn.LayerNorm(8, elementwise_affine=False)
        self.head = nn.Linear(8, num_classes)
        with torch.no_grad():
            self.blowup.weight.mul_(3e5)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.trunk(self.flatten(images)))
        return self.head(self.norm(self.blowup(hidden)))


def make_overflowing_linear(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return OverflowingLinear(input_shape, num_classes)


def scaled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float = 1e3):
    """Causal attention that scales q and k far up before their product and the scores back down
    after it: the same numbers as plain attention in fp32 and bf16 (fp32's range), but the
    product of q and k reaches about 1e7 and overflows fp16's 65504."""
    scores = (q * scale) @ (k * scale).transpose(-2, -1)
    scores = scores / (scale**2 * math.sqrt(q.shape[-1]))
    length = q.shape[-2]
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~causal, -math.inf).softmax(-1) @ v


class ScaledAttentionCore(nn.Module):
    """``scaled_attention`` as a module without parameters."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return scaled_attention(q, k, v)


class OverflowingAttention(nn.Module):
    """Self-attention whose core is ``ScaledAttentionCore`` (``core``), or with ``inline`` the
    plain function in this module's own forward."""

    def __init__(self, width: int, inline: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.core = None if inline else ScaledAttentionCore()
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        return self.proj(scaled_attention(q, k, v) if self.core is None else self.core(q, k, v))


class OverflowingAttentionLM(nn.Module):
    """A one-block causal LM whose attention core is the only place fp16 overflows: the Linears
    around it see ordinary values."""

    def __init__(self, vocab_size: int, seq_len: int, width: int, inline: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(seq_len, width)
        self.attn = OverflowingAttention(width, inline)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        x = x + self.attn(x)
        return self.head(self.norm(x))


def make_overflowing_attention(
    vocab_size: int, seq_len: int, width: int = 32, inline: bool = False
) -> nn.Module:
    return OverflowingAttentionLM(vocab_size, seq_len, width, inline)


# --- models that cannot train, and data with bad labels ----------------------------------------


class Unparametrized(nn.Module):
    """Logits sliced from the inputs: nothing for an optimizer to change."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.num_classes = num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)[:, : self.num_classes]


class IntegerTable(Unparametrized):
    def __init__(self, num_classes: int) -> None:
        super().__init__(num_classes)
        self.table = nn.Parameter(torch.zeros(num_classes, dtype=torch.long), requires_grad=False)


def make_untrainable(input_shape: tuple[int, ...], num_classes: int, kind: str) -> nn.Module:
    """A model with no parameters, integer parameters only, or every parameter frozen."""
    if kind == "none":
        return Unparametrized(num_classes)
    if kind == "integer":
        return IntegerTable(num_classes)
    return make_classifier(input_shape, num_classes).requires_grad_(False)


class ExitingClassifier(nn.Module):
    """Calls sys.exit(0) in its ``exit_at``-th forward (the first is amp_exp's output check)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, exit_at: int) -> None:
        super().__init__()
        self.model = make_classifier(input_shape, num_classes)
        self.exit_at, self.calls = exit_at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.exit_at:
            raise SystemExit(0)
        return self.model(x)


def make_exiting(input_shape: tuple[int, ...], num_classes: int, exit_at: int = 1) -> nn.Module:
    return ExitingClassifier(input_shape, num_classes, exit_at)


def make_badly_labelled(seed: int, kind: str, classes: int = 3):
    """make_labelled_vectors with labels a loss cannot take: ``kind`` names how."""
    train, held_out = make_labelled_vectors(seed, classes=classes)
    points, labels = train.tensors
    bad = {
        "too_large": labels + classes,
        "negative": labels - classes,
        "float": labels.float(),
        "one_hot": torch.nn.functional.one_hot(labels, classes).float(),
        "two_d": labels[:, None],
    }[kind]
    return TensorDataset(points, bad), held_out


def make_blobs(seed: int, size: int = 256, classes: int = 4):
    """docs/custom_models.md's my_pkg.make_data: 16-dimensional points, a Gaussian blob a class."""
    generator = torch.Generator().manual_seed(seed)
    centers = 3 * torch.randn(classes, 16, generator=generator)
    splits = []
    for count in (size, size // 4):
        labels = torch.randint(classes, (count,), generator=generator)
        splits.append(
            TensorDataset(centers[labels] + torch.randn(count, 16, generator=generator), labels)
        )
    return tuple(splits)


class MortalClassifier(nn.Module):
    """Rank 1 of a torchrun job is SIGKILLed in its ``die_at``-th forward, as by the OOM killer."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, die_at: int) -> None:
        super().__init__()
        self.model = make_classifier(input_shape, num_classes)
        self.die_at, self.calls = die_at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.die_at and os.environ.get("RANK") == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        return self.model(x)


class SignallingClassifier(nn.Module):
    """Sends its own process ``signum`` in its ``signal_at``-th forward, as a scheduler's
    preemption would, midway through whatever command runs it."""

    def __init__(self, input_shape, num_classes: int, signal_at: int, signum: str) -> None:
        super().__init__()
        self.model = make_classifier(input_shape, num_classes)
        self.signal_at, self.signum, self.calls = signal_at, signal.Signals[signum], 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.signal_at:
            os.kill(os.getpid(), self.signum)
        return self.model(x)


def make_signalling(
    input_shape: tuple[int, ...], num_classes: int, signal_at: int = 3, signum: str = "SIGTERM"
) -> nn.Module:
    return SignallingClassifier(input_shape, num_classes, signal_at, signum)


class FailingClassifier(ExitingClassifier):
    """Raises ValueError in its ``exit_at``-th forward: a bug of the model's own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.exit_at:
            raise ValueError("the model's own bug")
        return self.model(x)


def make_failing(input_shape: tuple[int, ...], num_classes: int, fail_at: int) -> nn.Module:
    return FailingClassifier(input_shape, num_classes, fail_at)


def make_mortal(input_shape: tuple[int, ...], num_classes: int, die_at: int = 4) -> nn.Module:
    return MortalClassifier(input_shape, num_classes, die_at)


# Models that defeat the precision they are trained in, each in its own way: the precision audit
# must notice and name the module (tests/test_audit.py).


class Fp32Island(nn.Module):
    """A linear layer that turns autocast off around its matmul, as code written for
    numerical safety does."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self.linear(x.float())


class FloatCaster(nn.Module):
    """A linear layer that casts its weights to float before using them."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.linear.weight.float(), self.linear.bias.float()
        return nn.functional.linear(x.float(), weight, bias).to(x.dtype)


class Fp32Matmul(torch.autograd.Function):
    """x @ w, always in fp32: custom_fwd casts its inputs under autocast."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        return grad @ weight.t(), x.t() @ grad


class CustomFp32(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / math.sqrt(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Fp32Matmul.apply(x, self.weight)


ISLANDS = {"autocast_off": Fp32Island, "float_weights": FloatCaster, "custom_fwd": CustomFp32}


def make_with_fp32_matmuls(
    input_shape: tuple[int, ...], num_classes: int, kind: str, width: int = 256
) -> nn.Module:
    """A classifier whose middle layer (``island``) keeps its matmuls in fp32, the ``kind`` way;
    with the default width it holds most of the model's matmul FLOPs."""
    layers = {
        "flatten": nn.Flatten(),
        "embed": nn.Linear(math.prod(input_shape), width),
        "act": nn.ReLU(),
        "island": ISLANDS[kind](width),
        "act2": nn.ReLU(),
        "head": nn.Linear(width, num_classes),
    }
    return nn.Sequential(OrderedDict(layers))


def make_token_labels(seed: int, vocab_size: int = 16, seq_len: int = 8, size: int = 64):
    """(train, eval) of token sequences labelled by whether their first token is even."""
    generator = torch.Generator().manual_seed(seed)
    splits = []
    for count in (size, size // 2):
        tokens = torch.randint(vocab_size, (count, seq_len), generator=generator)
        splits.append(TensorDataset(tokens, tokens[:, 0] % 2))
    return tuple(splits)


def make_transformers_gpt2(vocab_size: int) -> nn.Module:
    """A transformers model as a user would hand it over: it returns a ModelOutput."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=16, n_head=2, vocab_size=vocab_size)
    return AutoModelForCausalLM.from_config(config)


# --- data and models as Hugging Face users and others write them ----------------------------


def make_token_dicts(seed: int, vocab_size: int = 16, seq_len: int = 8, size: int = 64):
    """(train, eval) of counting sequences as a transformers dataset holds them: dicts of
    ``input_ids``, ``attention_mask`` (the last two positions of every other one padding) and
    ``labels`` at each token's own position, -100 where padded."""
    generator = torch.Generator().manual_seed(seed)
    splits = []
    for count in (size, size // 2):
        starts = torch.randint(vocab_size, (count, 1), generator=generator)
        ids = (starts + torch.arange(seq_len)) % vocab_size
        mask = torch.ones_like(ids)
        mask[::2, -2:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        splits.append(
            [
                {"input_ids": i, "attention_mask": m, "labels": lab}
                for i, m, lab in zip(ids, mask, labels, strict=True)
            ]
        )
    return tuple(splits)


def make_unlabelled_token_dicts(seed: int):
    """make_token_dicts without their labels: no target anywhere."""
    return tuple(
        [{"input_ids": sample["input_ids"]} for sample in split] for split in make_token_dicts(seed)
    )


def make_token_class_dicts(seed: int, vocab_size: int = 16, seq_len: int = 8, size: int = 64):
    """make_token_labels as dicts: ``input_ids``, ``attention_mask`` and a class ``labels``."""
    return tuple(
        [
            {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": label}
            for tokens, label in split
        ]
        for split in make_token_labels(seed, vocab_size, seq_len, size)
    )


class TwoInputs(nn.Module):
    """A classifier of two inputs, called as ``model(points, scale)``."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(8, num_classes)

    def forward(self, points: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.linear(points * scale[:, None])


def make_two_inputs(num_classes: int) -> nn.Module:
    return TwoInputs(num_classes)


def make_pairs_of_inputs(seed: int):
    """make_labelled_vectors whose inputs are a tuple (points, a per-sample scale)."""
    return tuple(
        [((points, torch.tensor(1.0 + i % 3)), label) for i, (points, label) in enumerate(split)]
        for split in make_labelled_vectors(seed)
    )


class TorchEncoderLM(nn.Module):
    """A causal LM of torch's own ``nn.TransformerEncoder``: its attention is an
    ``nn.MultiheadAttention``, which computes through ``F.multi_head_attention_forward``."""

    def __init__(
        self, vocab_size: int, seq_len: int, width: int, batch_first: bool, dropout: float
    ) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(seq_len, width)
        layer = nn.TransformerEncoderLayer(
            width, 2, 2 * width, dropout=dropout, batch_first=batch_first
        )
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position(torch.arange(length, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        x = x if self.batch_first else x.transpose(0, 1)
        x = self.encoder(x, mask=mask, is_causal=True)
        return self.head(x if self.batch_first else x.transpose(0, 1))


def make_torch_encoder_lm(
    vocab_size: int, seq_len: int, width: int = 16, batch_first: bool = True, dropout: float = 0.1
) -> nn.Module:
    return TorchEncoderLM(vocab_size, seq_len, width, batch_first, dropout)


class MultiheadAttentionLM(nn.Module):
    """A causal LM calling ``nn.MultiheadAttention`` directly, with or without its weights."""

    def __init__(self, vocab_size: int, seq_len: int, width: int, need_weights: bool) -> None:
        super().__init__()
        self.need_weights = need_weights
        self.embed = nn.Embedding(vocab_size, width)
        self.position = nn.Embedding(seq_len, width)
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position(torch.arange(length, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        attended, _ = self.attn(x, x, x, attn_mask=mask, need_weights=self.need_weights)
        return self.head(x + attended)


def make_multihead_attention_lm(
    vocab_size: int, seq_len: int, width: int = 16, need_weights: bool = False
) -> nn.Module:
    return MultiheadAttentionLM(vocab_size, seq_len, width, need_weights)


class SdpaBlock(nn.Module):
    """Self-attention written with ``F.scaled_dot_product_attention`` in the module's forward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.unflatten(-1, (2, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).flatten(2)


class SdpaLM(nn.Module):
    def __init__(self, vocab_size: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.attn = SdpaBlock(width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.head(x + self.attn(x))


def make_sdpa_lm(vocab_size: int, width: int = 16) -> nn.Module:
    return SdpaLM(vocab_size, width)
