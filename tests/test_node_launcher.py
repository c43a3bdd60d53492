"""hydra/launcher=node: a sweep's jobs in parallel on one node, one per GPU with its own
CUDA_VISIBLE_DEVICES, the rest queued; on a CPU node n_jobs at once with their share of the cores,
and their own timings flagged as measured under contention."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

from hydra_plugins.hydra_submitit_launcher import submitit_launcher as plugin

from helpers.runs import FAST, TINY_MLP, run_cli
from hydra_plugins import _amp_exp_submitit as launchers


def test_each_running_job_holds_a_gpu_of_its_own_and_the_rest_wait(monkeypatch) -> None:
    """5 jobs on a node that says it has 2 GPUs (faked): never more than 2 at once, never two
    on one GPU, every job run once in its own index, each told it shared the node with 1 more."""
    running: dict[int, list[int]] = {}
    seen, lock = [], threading.Lock()

    def fake_launch(launcher, overrides, index):
        (gpu,) = launcher.params["visible_gpus"]
        with lock:
            assert gpu not in running.values() and len(running) < 2, running
            running[index] = gpu
            seen.append((index, gpu, launcher.params["gpus_per_node"], launcher.params["setup"]))
        time.sleep(0.05)
        with lock:
            del running[index]
        return [f"result {index}"]

    monkeypatch.setattr(plugin.BaseSubmititLauncher, "launch", fake_launch)
    node = launchers.NodeLauncher(submitit_folder="x", gpus=2, n_jobs=None, setup=["ulimit -n"])
    results = node.launch([[f"seed={s}"] for s in range(5)], initial_job_idx=10)
    assert results == [f"result {i}" for i in range(10, 15)]
    assert sorted(index for index, *_ in seen) == list(range(10, 15))
    assert {gpu for _, gpu, *_ in seen} == {0, 1} and {n for _, _, n, _ in seen} == {1}
    # The user's setup first; no thread limit on a GPU node.
    assert all(setup == ["ulimit -n", "export AMP_EXP_PARALLEL_JOBS=2"] for *_, setup in seen)


def test_a_cpu_node_runs_n_jobs_with_a_share_of_the_cores_each(monkeypatch) -> None:
    seen = []
    monkeypatch.setattr(
        plugin.BaseSubmititLauncher,
        "launch",
        lambda launcher, overrides, index: seen.append(dict(launcher.params)) or [index],
    )
    monkeypatch.setattr(launchers.os, "cpu_count", lambda: 8)
    node = launchers.NodeLauncher(submitit_folder="x", gpus=0, n_jobs=2)
    assert node.launch([["seed=0"], ["seed=1"]], initial_job_idx=0) == [0, 1]
    for params in seen:
        assert params["visible_gpus"] == [] and params["gpus_per_node"] == 0
        assert "export OMP_NUM_THREADS=4" in params["setup"] and "n_jobs" not in params


@pytest.mark.slow
def test_two_parallel_cpu_jobs_complete_with_a_correct_report(tmp_path: Path) -> None:
    """Two jobs, one seed: the slots and the queue are the unit tests' above; this one is about
    the jobs the real launcher starts, each told it shares the node, and the report's words."""
    run_cli(
        "-m",
        "hydra/launcher=node",
        "hydra.launcher.n_jobs=2",
        "hydra.launcher.gpus=0",
        "precision=fp32,bf16",
        "report.speed_trial=false",
        *FAST,
        *TINY_MLP,
        f"hydra.sweep.dir={tmp_path}",
        timeout=600,
    )
    for job in ("0", "1"):
        summary = json.loads((tmp_path / job / "summary.json").read_text())
        assert summary["status"] == "completed"
        assert summary["launch_slot"]["parallel_jobs"] == 2
    report = json.loads((tmp_path / "report.json").read_text())
    assert [row["contended"] for row in report["runs"]] == [True] * 2
    (line,) = report["verdicts"]
    assert line.startswith("mlp: bf16 ") and "jobs timed in parallel on one node, under" in line
