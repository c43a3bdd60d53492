"""Numbers that stay right on several ranks: two gloo ranks under torchrun against one process.

One precision is one computation under every strategy; the diagnostics describe the whole model
under DDP and FSDP2 alike; gradient accumulation under DDP equals a larger batch. Each rank's
own generators at a resume: tests/test_ranks_resume.py.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import amp_exp.run as run
import ddp_jobs
from amp_exp.config.values import validate
from helpers.runs import FAST_TRAINER, composed
from helpers.torchrun import assert_bitwise_equal

pytestmark = pytest.mark.slow

# 16 sequences a step: one process takes them in one batch, two ranks in two micro-batches of 4
# each, the same sequences (each rank takes every other one of the epoch's order).
GPT = [
    *FAST_TRAINER,
    "model=gpt_tiny",
    "dataset=synthetic_tokens",
    "dataset.train_size=256",
    "dataset.eval_size=32",
    "trainer.max_steps=6",
    "diagnostics.underflow_every=2",
    "scheduler=none",
]
ONE_PROCESS = ["dataset.batch_size=16"]
TWO_RANKS = ["dataset.batch_size=4", "trainer.grad_accum_steps=2"]
# bf16 autocast rounds each matmul's output; over another split of the batch the loss after six
# steps moves by about 4e-5 of itself here.
BATCH_SPLIT_TOLERANCE = 1e-3


def one_process(out: Path, *overrides: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """The summary and final weights of a run in this process."""
    cfg = validate(copy.deepcopy(composed((*GPT, *ONE_PROCESS, *overrides))))
    kept: dict[str, torch.Tensor] = {}
    train_built = run.train_built

    def keep_weights(cfg, built, *rest):
        summary = train_built(cfg, built, *rest)
        kept.update(
            {name: value.detach().clone() for name, value in built.model.state_dict().items()}
        )
        return summary

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run, "train_built", keep_weights)
        summary = run.train(cfg, out)
    return summary, kept


# The two-rank jobs, in the session's shared launch (tests/ddp_jobs.py).
RANK_JOBS = {
    name: ddp_jobs.declare(f"ranks_{name}", *GPT, *TWO_RANKS, *overrides)
    for name, overrides in {
        "ddp_bf16": ["precision=bf16"],
        "fsdp2_bf16": ["precision=bf16", "trainer.strategy=fsdp2"],
        "fsdp2_fp32": ["precision=fp32", "trainer.strategy=fsdp2"],
    }.items()
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared_rank_jobs) -> dict[str, dict]:
    """gpt_tiny in bf16 in one process, under DDP and under FSDP2; and in fp32 (whose gradients
    do not depend on how the batch is split) in one process and under FSDP2."""
    out = tmp_path_factory.mktemp("ranks")
    found: dict[str, dict] = {}
    for precision in ("bf16", "fp32"):
        summary, weights = one_process(out / f"one_{precision}", f"precision={precision}")
        found[f"one_{precision}"] = {"summary": summary, "model": weights}
    _, states = shared_rank_jobs
    found.update((name, states[job][0]) for name, job in RANK_JOBS.items())
    return found


def diagnostics(summary: dict) -> tuple:
    return summary["underflow"], summary["suggested_init_scale"]


def test_fsdp2_underflow_statistics_are_those_of_one_process(runs) -> None:
    """Every rank measures its shards; the counts are summed over the ranks and the largest
    gradient is the largest of theirs, so the fractions, the worst layers and the suggested
    init_scale are those of the whole model (rank 0's shard alone gave others)."""
    one, sharded = runs["one_fp32"]["summary"], runs["fsdp2_fp32"]["summary"]
    assert one["underflow"]["step"] == 6 and len(one["underflow"]["worst"]) == 5
    assert diagnostics(sharded) == diagnostics(one)
    assert sharded["stale_weight_frac"] == one["stale_weight_frac"]


def test_diagnostics_under_ddp_and_fsdp2_describe_the_same_whole_model(runs) -> None:
    ddp, sharded = runs["ddp_bf16"]["summary"], runs["fsdp2_bf16"]["summary"]
    assert diagnostics(ddp) == diagnostics(sharded)
    assert ddp["checks"] == sharded["checks"]
    assert ddp["checks"]["unscaled_grads_fp32_finite"] == {"passed": True, "offenders": []}


def test_bf16_is_one_computation_in_one_process_under_ddp_and_under_fsdp2(runs) -> None:
    """FSDP2 gathers the fp32 weights and autocasts, as DDP does (its bf16 parameter policy ran
    the embeddings, norms and residual stream in bf16): the two strategies train the same
    model, and one process on the same batches ends within the batch split's rounding."""
    one = runs["one_bf16"]["summary"]
    ddp, sharded = runs["ddp_bf16"], runs["fsdp2_bf16"]
    for summary in (ddp["summary"], sharded["summary"]):
        assert (summary["param_dtype"], summary["reduce_dtype"]) == ("fp32", "fp32")
        for loss in ("final_loss", "eval_loss"):
            assert summary[loss] == pytest.approx(one[loss], rel=BATCH_SPLIT_TOLERANCE)
    assert (one["strategy"], one["param_dtype"], one["reduce_dtype"]) == ("single", "fp32", None)
    assert ddp["summary"]["final_loss"] == sharded["summary"]["final_loss"]
    assert_bitwise_equal(ddp["model"], sharded["model"])


def test_gradient_accumulation_under_ddp_equals_one_batch_twice_as_large(runs) -> None:
    """Two micro-batches per rank, the first under no_sync, update the weights as one process's
    batch of all four does: within bf16's rounding of the gradients, far from the factor 2 of a
    micro-batch counted twice."""
    start = build_initial_weights()
    one, ddp = runs["one_bf16"]["model"], runs["ddp_bf16"]["model"]
    for name, initial in start.items():
        expected = one[name] - initial
        error = torch.linalg.vector_norm(ddp[name] - initial - expected)
        assert error <= 0.05 * torch.linalg.vector_norm(expected) + 1e-7, name


def build_initial_weights() -> dict[str, torch.Tensor]:
    cfg = validate(copy.deepcopy(composed((*GPT, *ONE_PROCESS, "precision=bf16"))))
    return {name: value.clone() for name, value in run.build(cfg).model.state_dict().items()}
