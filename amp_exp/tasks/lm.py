"""Next-token prediction: cross-entropy over the vocabulary at every position, and perplexity.

Throughput counts tokens: a sample is one sequence of ``seq_len`` predicted tokens.

A batch is (inputs, targets): the token ids, or any inputs tasks/inputs.py takes whose primary
input holds them. Targets given beside the inputs are the next tokens, position by position;
a dict's ``labels`` follow transformers' convention instead, each at its own token's position,
shifted here as transformers' loss shifts them. A target of -100 (transformers' padding label)
is not predicted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from amp_exp.tasks.inputs import (
    Inputs,
    call,
    each_tensor,
    primary,
    split,
    with_primary,
)
from amp_exp.tasks.metrics import Metric, TaskMetrics, ToleranceUnit

Batch = tuple[Inputs, torch.Tensor]
# A target that is not predicted: cross-entropy's default ignore_index, transformers' padding.
IGNORED = -100

# Rows of a batch the causal check changes, each after its own cut: in eval mode rows do not
# mix, so four cuts spread from the first to the second-to-last position cost two forward passes
# of four sequences, whatever the batch size.
CAUSAL_CHECK_ROWS = 4
# A change in logits beyond this share of their largest magnitude is a leak. A causal model's
# logits before the cut are identical (the same kernels on the same prefix); an encoder's at
# initialization move by 3-15% (BERT and RoBERTa on 32 tokens).
CAUSAL_TOLERANCE = 1e-4


class LanguageModelTask:
    unit = "tokens"
    eval_sum_names = ("loss_sum", "tokens")
    # Judged on the eval loss, relative to fp32's: 1% is four times DeepSeek-V3's 0.25% bar,
    # which short runs on small data cannot resolve.
    metrics = TaskMetrics(
        (Metric("eval_loss", "loss"), Metric("eval_perplexity", "perplexity", ".2f")),
        quality="eval_loss",
        higher_is_better=False,
        tolerance_unit=ToleranceUnit.relative,
        default_tolerance=0.01,
    )

    def __init__(self, device: torch.device, seq_len: int, vocab_size: int) -> None:
        self.device = device
        self.units_per_sample = seq_len
        self.vocab_size = vocab_size

    def to_device(self, batch) -> Batch:
        inputs, targets = split(batch)
        inputs = each_tensor(inputs, lambda t: t.to(self.device, non_blocking=True))
        # Token data may be stored as int32 (half the memory); embeddings and cross-entropy
        # index with int64.
        inputs = with_primary(inputs, primary(inputs).long())
        targets = targets.to(self.device, non_blocking=True).long()
        if isinstance(batch, Mapping):
            # A dict's labels follow transformers' convention: each sits at its own token, and
            # the last position predicts none.
            targets = F.pad(targets[:, 1:], (0, 1), value=IGNORED)
        return inputs, targets

    def batch_samples(self, batch: Batch) -> int:
        return batch[1].shape[0]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs, targets = batch
        # fp32 logits: under autocast they come out of the head in fp16/bf16, and the loss is a
        # log-softmax over the whole vocabulary, whose small probabilities low precision loses.
        logits = call(model, inputs).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORED)

    def eval_sums(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs, targets = batch
        logits = call(model, inputs).float()
        loss_sum = F.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORED, reduction="sum"
        )
        count = (targets != IGNORED).sum()
        return torch.stack([loss_sum.double(), count.double()])

    def eval_metrics(self, totals: list[float]) -> dict[str, float | None]:
        loss_sum, count = totals
        if count == 0:
            return {"eval_loss": None, "eval_perplexity": None}
        eval_loss = loss_sum / count
        try:
            perplexity = math.exp(eval_loss)
        except OverflowError:  # a diverged run's loss
            perplexity = math.inf
        return {"eval_loss": eval_loss, "eval_perplexity": perplexity}

    def output_problem(self, model: nn.Module, batch: Batch) -> str | None:
        inputs, targets = batch
        tokens = primary(inputs)
        problem = self.token_problem(tokens, targets)
        if problem:
            return problem
        outputs = call(model, inputs)
        expected = f"[{tokens.shape[0]}, {tokens.shape[1]}, vocab_size>={self.vocab_size}]"
        if not isinstance(outputs, torch.Tensor):
            return f"returns {type(outputs).__name__}, not a tensor of logits {expected}"
        shape = tuple(outputs.shape)
        if len(shape) != 3 or shape[:2] != tuple(tokens.shape) or shape[2] < self.vocab_size:
            return f"returns logits of shape {list(shape)}, expected {expected}"
        return None

    def future_leak(self, model: nn.Module, batch: Batch) -> str | None:
        """Where the model's logits at a position t change when only the tokens after t change,
        or None: a language model that sees later tokens reads the targets it is trained on
        (they are its inputs shifted by one), and its loss means nothing. The caller runs it
        in eval mode, without gradients."""
        inputs = each_tensor(batch[0], lambda t: t[:CAUSAL_CHECK_ROWS])
        tokens = primary(inputs)
        rows, length = tokens.shape
        if length < 2:  # no later token to change
            return None
        cuts = torch.arange(rows, device=tokens.device) * (length - 2) // max(rows - 1, 1)
        later = torch.arange(length, device=tokens.device) > cuts[:, None]
        changed = torch.where(later, (tokens + 1) % self.vocab_size, tokens)
        before = call(model, inputs).float()
        after = call(model, with_primary(inputs, changed)).float()
        # Per row: the largest change in any logit at or before its cut.
        moved = (before - after).abs().amax(dim=-1).masked_fill(later, 0).amax(dim=-1)
        leaks = (moved > CAUSAL_TOLERANCE * before.abs().amax(dim=(1, 2))).tolist()
        if not any(leaks):
            return None
        row = leaks.index(True)
        return (
            f"its logits up to position {int(cuts[row])} change (by up to {float(moved[row]):.2g}) "
            "when only the tokens after it change, so it sees the next tokens it learns to predict"
        )

    def token_problem(self, inputs: torch.Tensor, targets: torch.Tensor) -> str | None:
        """What makes a batch's token ids something the embedding or the loss cannot take."""
        if inputs.dim() != 2 or targets.shape != inputs.shape:
            return (
                f"its inputs {list(inputs.shape)} and targets {list(targets.shape)} are not "
                "[batch, seq_len] sequences of one shape"
            )
        for name, ids in (("inputs", inputs), ("targets", targets[targets != IGNORED])):
            if not ids.numel():
                continue
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.vocab_size:
                return (
                    f"its {name} hold token id {low if low < 0 else high}, outside the "
                    f"vocabulary [0, {self.vocab_size}) (dataset.vocab_size)"
                )
        return None
