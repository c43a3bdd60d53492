"""Classification: cross-entropy on class logits, accuracy from the arg-max.

A batch is (inputs, labels): the inputs an image tensor, or any inputs tasks/inputs.py takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from amp_exp.tasks.inputs import Inputs, call, each_tensor, primary, split
from amp_exp.tasks.metrics import Metric, TaskMetrics, ToleranceUnit

Batch = tuple[Inputs, torch.Tensor]


class ClassificationTask:
    unit = "samples"
    units_per_sample = 1
    eval_sum_names = ("loss_sum", "correct", "count")
    metrics = TaskMetrics(
        (Metric("eval_loss", "loss"), Metric("eval_acc", "accuracy", ".2%")),
        quality="eval_acc",
        higher_is_better=True,
        tolerance_unit=ToleranceUnit.points,
        default_tolerance=0.5,
    )

    def __init__(self, device: torch.device, num_classes: int, channels_last: bool = False) -> None:
        self.device = device
        self.num_classes = num_classes
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format

    def to_device(self, batch) -> Batch:
        inputs, labels = split(batch)

        def moved(tensor: torch.Tensor) -> torch.Tensor:
            # channels_last is a layout of images: 4-D tensors only.
            layout = self.memory_format if tensor.dim() == 4 else torch.preserve_format
            return tensor.to(self.device, non_blocking=True, memory_format=layout)

        return each_tensor(inputs, moved), labels.to(self.device, non_blocking=True)

    def batch_samples(self, batch: Batch) -> int:
        return batch[1].shape[0]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs, labels = batch
        return F.cross_entropy(call(model, inputs), labels)

    def eval_sums(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        inputs, labels = batch
        logits = call(model, inputs)
        # Summed in fp32 from float logits: a half-precision sum over a batch loses digits.
        loss_sum = F.cross_entropy(logits.float(), labels, reduction="sum")
        correct = (logits.argmax(dim=1) == labels).sum()
        count = torch.tensor(labels.shape[0], device=labels.device)
        return torch.stack([loss_sum.double(), correct.double(), count.double()])

    def eval_metrics(self, totals: list[float]) -> dict[str, float | None]:
        loss_sum, correct, count = totals
        if count == 0:
            return {"eval_loss": None, "eval_acc": None}
        return {"eval_loss": loss_sum / count, "eval_acc": correct / count}

    def output_problem(self, model: nn.Module, batch: Batch) -> str | None:
        inputs, labels = batch
        samples = primary(inputs).shape[0]
        problem = self.label_problem(labels, samples)
        if problem:
            return problem
        outputs = call(model, inputs)
        expected = f"[{samples}, {self.num_classes}]"
        if not isinstance(outputs, torch.Tensor):
            # torchvision's googlenet and inception_v3 return auxiliary logits while training.
            return f"returns {type(outputs).__name__}, not a tensor of class logits {expected}"
        if tuple(outputs.shape) != (samples, self.num_classes):
            return f"returns logits of shape {list(outputs.shape)}, expected {expected}"
        return None

    def label_problem(self, labels: torch.Tensor, batch_size: int) -> str | None:
        """What makes a batch's labels something cross-entropy cannot take: one class index per
        sample, an integer in [0, num_classes)."""
        valid = f"one class index in [0, {self.num_classes}) per sample"
        if tuple(labels.shape) != (batch_size,):
            return (
                f"its labels have shape {list(labels.shape)}, not [{batch_size}]: {valid}"
                " (for one-hot labels, their argmax)"
            )
        if labels.is_floating_point() or labels.is_complex() or labels.dtype is torch.bool:
            return f"its labels are {labels.dtype}, not {valid} (an integer tensor)"
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= self.num_classes:
            return (
                f"its labels hold {low if low < 0 else high}, outside [0, {self.num_classes}) "
                f"for {self.num_classes} classes (dataset.num_classes)"
            )
        return None
