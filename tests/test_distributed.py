"""The single-process pieces of data-parallel training: sharding, rank detection, agreed names."""

from __future__ import annotations

from datetime import datetime

import pytest
import torch
from torch.distributed import TCPStore
from torch.utils.data import TensorDataset

from amp_exp import launch
from amp_exp.errors import ConfigError, RuntimeFault
from amp_exp.launch import WorkerRank, launch_time, log_file_suffix, worker_rank
from amp_exp.results.resume import check_ranks_resumed_alike, find_checkpoint, resume
from amp_exp.run import build, train
from amp_exp.tasks.images import build_data, make_synthetic
from amp_exp.tasks.sampling import (
    DeviceTensorLoader,
    EpochShuffleSampler,
    Placement,
    dataset_loaders,
    epoch_permutation,
    shard,
)

CPU = torch.device("cpu")


def test_shards_are_disjoint_equal_and_cover_all_but_the_ragged_tail():
    order = epoch_permutation(103, seed=0, epoch=0)
    shards = [shard(order, rank, 4) for rank in range(4)]
    assert {len(s) for s in shards} == {25}
    assert sorted(torch.cat(shards).tolist()) == sorted(order[:100].tolist())
    assert torch.equal(shard(order, 0, 1), order)


def test_sampler_shards_each_epoch_differently_and_resumes_mid_shard():
    samplers = [
        EpochShuffleSampler(40, Placement(3, CPU, WorkerRank(rank, 2, rank))) for rank in (0, 1)
    ]
    epoch0 = [list(s) for s in samplers]
    assert not set(epoch0[0]) & set(epoch0[1]) and len(epoch0[0]) == len(samplers[0]) == 20
    for s in samplers:
        s.set_epoch(1)
    assert [list(s) for s in samplers] != epoch0
    samplers[1].set_epoch(0, start=5)
    assert list(samplers[1]) == epoch0[1][5:] and len(samplers[1]) == 15


def test_device_loader_gives_each_rank_batches_of_its_own_shard():
    images = torch.arange(64.0).reshape(64, 1, 1, 1)
    loaders = [
        DeviceTensorLoader(
            images,
            images.flatten(),
            batch_size=8,
            shuffled_for=Placement(0, CPU, WorkerRank(r, 2, r)),
        )
        for r in (0, 1)
    ]
    seen = [torch.cat([labels for _, labels in loader]).tolist() for loader in loaders]
    assert [len(loader) for loader in loaders] == [4, 4]
    assert not set(seen[0]) & set(seen[1]) and len(seen[0] + seen[1]) == 64


def rank_of_two(rank: int, seed: int = 5) -> Placement:
    return Placement(seed, CPU, WorkerRank(rank, 2, rank))


def expected_rows(rank: int, train_size: int, batch_size: int, epoch: int, start_batch: int):
    """What rank ``rank`` of two trains on from ``start_batch`` of ``epoch`` (seed 5): its shard
    of the epoch's order, whole batches only."""
    mine = shard(epoch_permutation(train_size, seed=5, epoch=epoch), rank, 2)
    batches = len(mine) // batch_size
    return mine[start_batch * batch_size : batches * batch_size]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_of_two_trains_on_its_shard_of_the_seeded_order_and_evaluates_every_other_image(
    run_cfg, rank
):
    cfg = run_cfg(
        "dataset.train_size=100",
        "dataset.eval_size=21",
        "dataset.batch_size=8",
        "dataset.image_size=4",
    )
    data = build_data(cfg.dataset, rank_of_two(rank))
    data.train.set_epoch(1, start_batch=2)
    images, labels = make_synthetic(cfg.dataset, 100, 5, 0, CPU)
    rows = expected_rows(rank, 100, 8, epoch=1, start_batch=2)
    trained = [torch.cat(parts) for parts in zip(*data.train, strict=True)]
    assert torch.equal(trained[0], images[rows]) and torch.equal(trained[1], labels[rows])
    eval_images, _ = make_synthetic(cfg.dataset, 21, 5, 1, CPU)
    evaluated = torch.cat([batch_images for batch_images, _ in data.eval])
    assert torch.equal(evaluated, eval_images[rank::2])


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_of_two_loads_its_shard_and_eval_share_of_a_map_style_dataset(rank):
    train_set, eval_set = TensorDataset(torch.arange(50)), TensorDataset(torch.arange(21))
    train, held_out = dataset_loaders(train_set, eval_set, 4, None, 0, rank_of_two(rank))
    train.set_epoch(1, start_batch=2)
    assert torch.cat([b for (b,) in train]).tolist() == expected_rows(rank, 50, 4, 1, 2).tolist()
    assert torch.cat([b for (b,) in held_out]).tolist() == list(range(rank, 21, 2))


def test_worker_rank_comes_from_torchruns_environment(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert worker_rank() is None
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match="start data-parallel runs with torchrun"):
        worker_rank()
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert worker_rank() == WorkerRank(rank=3, world_size=4, local_rank=1)
    assert log_file_suffix() == ".rank3"


def test_every_worker_takes_the_launch_time_the_first_one_published(monkeypatch):
    """Workers' clocks differ; the run directory must not. The store holds the first answer."""
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-42")
    monkeypatch.setenv("WORLD_SIZE", "2")
    clocks = iter([datetime(2026, 1, 1, 9, 0, 0), datetime(2026, 1, 1, 9, 0, 1)])

    class SkewedClock(datetime):
        @classmethod
        def now(cls, tz=None):
            return next(clocks)

    monkeypatch.setattr(launch, "datetime", SkewedClock)
    answers = []
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        launch_time.cache_clear()
        answers.append(launch_time())
    launch_time.cache_clear()
    assert answers == [datetime(2026, 1, 1, 9, 0, 0)] * 2
    assert store.get("amp_exp/launch_time/job-42") == b"2026-01-01T09:00:00"


def test_a_checkpoint_resumes_only_with_the_ranks_that_wrote_it(run_cfg, tmp_path):
    train(run_cfg(), tmp_path)
    cfg = run_cfg("resume=auto")
    built = build(cfg)
    built.engine.world_size = 2
    with pytest.raises(RuntimeFault, match="written by 1 data-parallel ranks and this run has 2"):
        resume(cfg, built.engine, tmp_path, find_checkpoint(cfg, tmp_path, None), writes=True)


def test_ranks_that_resumed_at_different_steps_stop_with_one_line(run_cfg):
    class RanksAt:
        """Stands in for the process group of this rank and one other, resumed at ``step``."""

        def __init__(self, step: int) -> None:
            # What the other rank contributes to each all-reduce, in the order they are made.
            self.contributions = iter([-step, step])

        def max(self, value: float) -> float:
            return max(value, next(self.contributions))

    check_ranks_resumed_alike(RanksAt(0), 0)
    with pytest.raises(RuntimeFault, match=r"resumed at different steps \(0 to 4\)"):
        check_ranks_resumed_alike(RanksAt(4), 0)
