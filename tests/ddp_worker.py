"""One rank of a data-parallel test run; tests/test_ddp.py starts two of these with torchrun.

Usage: torchrun --standalone --nproc_per_node=2 tests/ddp_worker.py OUTPUT_DIR [--inf-at STEP]
[--signal-at CALL] [--die-at CALL] [OVERRIDE ...]

Run as a script, its directory (tests/) is on sys.path, so it imports conftest's helpers.
Faults are injected on rank 1 only. Each rank saves what it ended with to OUTPUT_DIR/rank<r>.pt,
so the test can compare the replicas itself rather than trust the run's own check.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

import amp_exp.run as run
from amp_exp.config.preflight import CONF_DIR, CONFIG_NAME
from amp_exp.config.store import register_configs
from amp_exp.config.validate import validate
from conftest import inf_loss_at, signal_self_at_call


def die_at_call(n: int):
    """A loss function whose process dies on its n-th call, as a crashed or killed worker does."""
    calls = 0

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == n:
            os._exit(1)
        return F.cross_entropy(logits, labels)

    return loss_fn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--inf-at", type=int, help="optimizer step whose loss is inf on rank 1")
    parser.add_argument("--signal-at", type=int, help="loss call at which rank 1 gets SIGUSR1")
    parser.add_argument(
        "--die-at", type=int, help="loss call at which rank 1 of torchrun's first attempt dies"
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    rank = int(os.environ["RANK"])

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = validate(compose(CONFIG_NAME, overrides=args.overrides))
    loss_fn = None
    if rank == 1 and args.inf_at is not None:
        loss_fn = inf_loss_at({args.inf_at})
    if rank == 1 and args.signal_at is not None:
        loss_fn = signal_self_at_call(args.signal_at)
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    if rank == 1 and args.die_at is not None and first_attempt:
        loss_fn = die_at_call(args.die_at)

    built_runs = []
    real_build = run.build

    def keep_built(*build_args, **build_kwargs):
        built = real_build(*build_args, **build_kwargs)
        built_runs.append(built)
        return built

    run.build = keep_built
    summary = run.train(cfg, args.output_dir, loss_fn)
    built = built_runs[0]
    torch.save(
        {
            "model": built.model.state_dict(),
            "scale": built.engine.policy.scale(),
            "summary": summary,
        },
        args.output_dir / f"rank{rank}.pt",
    )


if __name__ == "__main__":
    main()
