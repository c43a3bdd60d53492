"""One rank of a data-parallel test run; tests/test_ddp.py starts two of these with torchrun.

Usage: torchrun --standalone --nproc_per_node=2 tests/ddp_worker.py OUTPUT_DIR [--inf-at STEP]
[--inf-in-shard-at STEP] [--signal-at CALL [--stop-signal NAME]] [--die-at CALL]
[--peak-tflops PEAK] [--ticking-clock] [--linear-dtypes] [--probe SPEEDS_JSON] [OVERRIDE ...]

Run as a script, its directory (tests/) is on sys.path, so it imports tests/helpers/.
Faults are injected on rank 1 only. Each rank saves what it ended with to OUTPUT_DIR/rank<r>.pt
(under FSDP2 the whole model, gathered from the shards), so the test can compare the ranks itself
rather than trust the run's own check. Also used by tests/test_fsdp.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
from pathlib import Path

import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir

import amp_exp.build
import amp_exp.run as run
from amp_exp.config.preflight import CONF_DIR, CONFIG_NAME
from amp_exp.config.store import register_configs
from amp_exp.config.values import validate
from amp_exp.runtime.fsdp import local, whole
from amp_exp.tasks import workload
from amp_exp.training.engine import Engine
from amp_exp.training.meters import Throughput
from helpers.matmul_dtypes import linear_dtypes
from helpers.probes import inject_probe
from helpers.runs import (
    inf_loss_at,
    meter_with_peak,
    overriding_loss,
    signal_self_at_call,
    ticking_clock,
)


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


def inf_in_own_shard_at(engine: Engine, step: int, inject: bool, seen: dict) -> None:
    """At optimizer step ``step``, after the gradients are reduced and before the scaler checks
    them, put an inf into this rank's shard of the first gradient (if ``inject``). ``seen`` gets
    what the rank saw then: whether its own shards were all finite."""
    policy, parameters = engine.precision, engine.parameters
    real_unscale, calls = policy.unscale, 0

    def unscale_with_inf(optimizer):
        nonlocal calls
        calls += 1
        if calls == step:
            if inject:
                local(parameters[0].grad).view(-1)[0] = float("inf")
            seen["shard_finite"] = all(
                bool(torch.isfinite(local(p.grad)).all()) for p in parameters if p.grad is not None
            )
        return real_unscale(optimizer)

    policy.unscale = unscale_with_inf


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--inf-at", type=int, help="optimizer step whose loss is inf on rank 1")
    parser.add_argument(
        "--inf-in-shard-at", type=int, help="optimizer step whose gradient shard is inf on rank 1"
    )
    parser.add_argument("--signal-at", type=int, help="loss call at which rank 1 is signalled")
    parser.add_argument("--stop-signal", default="SIGUSR1", help="what --signal-at sends")
    parser.add_argument(
        "--die-at", type=int, help="loss call at which rank 1 of torchrun's first attempt dies"
    )
    parser.add_argument("--peak-tflops", type=float, help="a device peak, so the CPU has MFU")
    parser.add_argument(
        "--ticking-clock", action="store_true", help="each throughput clock read is 1 s later"
    )
    parser.add_argument(
        "--linear-dtypes", action="store_true", help="save each linear's output dtype in training"
    )
    parser.add_argument(
        "--probe",
        type=json.loads,
        help="each precision's speed relative to fp32's, as a probe cached for this job measured",
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
        loss_fn = signal_self_at_call(args.signal_at, signal.Signals[args.stop_signal])
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    if rank == 1 and args.die_at is not None and first_attempt:
        loss_fn = die_at_call(args.die_at)

    if args.probe is not None:
        # A cache of this rank's own, so the ranks never write one file at once.
        os.environ["XDG_CACHE_HOME"] = str(args.output_dir / f"cache.rank{rank}")
        inject_probe(args.probe)
    if args.peak_tflops is not None:
        amp_exp.build.Meter = meter_with_peak(args.peak_tflops)
    if args.ticking_clock:
        Throughput._now = ticking_clock()
    real_build, real_train_built = run.build, run.train_built
    final: dict = {}

    recording = contextlib.ExitStack()

    def build_with_faults(*build_args, **build_kwargs):
        built = real_build(*build_args, **build_kwargs)
        if args.inf_in_shard_at is not None:
            inf_in_own_shard_at(built.engine, args.inf_in_shard_at, rank == 1, final)
        if args.linear_dtypes:
            final["linear_dtypes"] = recording.enter_context(linear_dtypes(built.model))
        return built

    def train_and_keep(cfg, built, *rest):
        summary = real_train_built(cfg, built, *rest)
        # While the process group is open: every rank gathers each FSDP2 shard, in one order.
        final["model"] = {name: whole(value) for name, value in built.model.state_dict().items()}
        final["scale"] = built.engine.precision.scale()
        return summary

    run.build, run.train_built = build_with_faults, train_and_keep
    if loss_fn is not None:
        workload.make_task = overriding_loss(loss_fn)
    with recording:
        final["summary"] = run.train(cfg, args.output_dir)
    if args.linear_dtypes:
        final["linear_dtypes"] = {n: str(d[0]) for n, d in final["linear_dtypes"].items()}
    torch.save(final, args.output_dir / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
