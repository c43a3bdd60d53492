"""What other trainers call the metrics amp_exp's tasks declare: the one mapping every writer of
amp_exp/integrations/ reads, so a run of the HF Trainer (``eval_accuracy``), of Lightning
(``val_loss``, ``val_acc``) or of a plain loop is judged on the task's own metric."""

from __future__ import annotations

from typing import Any

from amp_exp.config.schema import TaskName
from amp_exp.tasks.metrics import TaskMetrics
from amp_exp.tasks.workload import declared_metrics

# The names each task metric goes by. The HF Trainer prefixes ``eval_`` to what
# compute_metrics returns; Lightning logs whatever the user names it, often ``val_``;
# ``_epoch`` is what Lightning appends to a metric logged on both steps and epochs.
ALIASES: dict[str, tuple[str, ...]] = {
    "eval_loss": ("val_loss", "valid_loss", "validation_loss", "test_loss"),
    "eval_acc": (
        "eval_accuracy",
        "val_acc",
        "val_accuracy",
        "valid_acc",
        "validation_accuracy",
        "test_acc",
        "accuracy",
        "acc",
    ),
    "eval_perplexity": ("eval_ppl", "val_perplexity", "val_ppl", "perplexity", "ppl"),
}
EPOCH_SUFFIX = "_epoch"


def task_metrics(task: str | TaskMetrics) -> tuple[str, TaskMetrics]:
    """The task's name and its metric declaration: ``classification``, ``lm``, or a
    ``TaskMetrics`` of the user's own (its name is then ``custom``)."""
    if isinstance(task, TaskMetrics):
        return "custom", task
    try:
        name = TaskName(task)
    except ValueError:
        valid = ", ".join(t.value for t in TaskName)
        raise ValueError(
            f"task={task!r} is not an option; valid choices: {valid} (or a TaskMetrics)"
        ) from None
    return name.value, declared_metrics(name)


def task_names(metrics: dict[str, Any], declared: TaskMetrics) -> tuple[dict[str, float], list]:
    """``metrics`` under the task's names (those it declares and their aliases), as floats, and
    the names no declared metric goes by. The task's own name wins over an alias."""
    mapped: dict[str, float] = {}
    used = set()
    for name in declared.names:
        for candidate in (name, *ALIASES.get(name, ())):
            found = next(
                (key for key in (candidate, candidate + EPOCH_SUFFIX) if key in metrics), None
            )
            if found is not None and metrics[found] is not None:
                mapped[name] = float(metrics[found])
                used.add(found)
                break
    return mapped, sorted(set(metrics) - used)


def looked_for(name: str) -> str:
    """The names a task metric was looked for under, in words."""
    return ", ".join((name, *ALIASES.get(name, ())))
