"""The task boundary: what the engine trains, without knowing what it is.

A task owns the model's inputs and its loss. It moves a batch to the device, computes the loss
(the engine calls it under the precision's autocast), and sums evaluation statistics on the
device, so the engine reads them once per evaluation. Its ``unit`` names what throughput counts:
samples for images, tokens for text.

A task declares its metrics (``tasks.metrics.TaskMetrics``): the summary, the console, W&B and
the report read that declaration, so a new task needs no edit anywhere else.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from amp_exp.tasks.metrics import TaskMetrics

Batch = Any


class Batches(Protocol):
    """A loader whose order in epoch e depends only on (seed, e), and that can start mid-epoch."""

    def __iter__(self) -> Iterator[Batch]: ...

    def __len__(self) -> int: ...

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None: ...


@dataclass
class DataBundle:
    train: Batches
    eval: Batches
    # What a model builder may need from the data: input_shape and num_classes for images,
    # vocab_size and seq_len for tokens.
    facts: dict[str, Any] = field(default_factory=dict)
    # What the data adds to summary.json: the synthetic tokens' loss_floor.
    recorded: dict[str, Any] = field(default_factory=dict)


class Task(Protocol):
    """Batches in, a loss and summed metrics out."""

    # The metrics ``eval_metrics`` returns, and which one judges quality.
    metrics: TaskMetrics

    # What throughput counts besides samples: "samples" or "tokens".
    unit: str
    # How many units one sample holds (1 for images, seq_len for next-token prediction).
    units_per_sample: int
    # The names of the statistics ``eval_sums`` returns, in order.
    eval_sum_names: Sequence[str]

    def to_device(self, batch: Batch) -> Batch: ...

    def batch_samples(self, batch: Batch) -> int: ...

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """The batch's mean loss; runs under the precision's autocast."""
        ...

    def eval_sums(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """One float64 tensor of per-batch sums, in ``eval_sum_names`` order, on the device."""
        ...

    def eval_metrics(self, totals: list[float]) -> dict[str, float | None]:
        """The summed statistics of a whole evaluation turned into its metrics."""
        ...

    def output_problem(self, model: nn.Module, batch: Batch) -> str | None:
        """Why one batch (its labels or token ids), or the model's output on it, cannot be
        trained on, or None if it can."""
        ...
