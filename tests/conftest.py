"""Fixtures every test gets: registered schemas, W&B, matplotlib and measurement caches kept
local (nothing depends on the home directory), and the real config composed from conf/ and
shrunk. Shared helpers live in tests/helpers/."""

from __future__ import annotations

import copy
import functools
import importlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import pytest
import torch
from omegaconf import DictConfig

from amp_exp.__main__ import register_plugins
from amp_exp.config.schema import RunConfig
from amp_exp.config.store import register_configs
from amp_exp.config.values import validate
from amp_exp.runtime.signals import PREEMPTION_SIGNALS
from amp_exp.tasks import workload
from helpers.probes import inject_probe
from helpers.runs import FAST, composed, overriding_loss
from helpers.warm_python import WarmProcess, python_m, start_python_m


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Workers share the cores: one torch thread per process, here and in every process a
        # test starts. Two OpenMP threads per process on a busy core wait on each other.
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    else:
        # Matplotlib keeps its config and font cache in the home directory, whose state no test
        # may depend on: one folder of the session's own, set before any test module imports
        # matplotlib (which reads it once), and inherited by the xdist workers and every process
        # a test starts.
        matplotlib_dir = tempfile.mkdtemp(prefix="amp_exp-tests-matplotlib-")
        os.environ["MPLCONFIGDIR"] = matplotlib_dir
        config.add_cleanup(lambda: shutil.rmtree(matplotlib_dir, ignore_errors=True))


@pytest.fixture(scope="session", autouse=True)
def _registered_schemas() -> None:
    register_configs()
    register_plugins()


@pytest.fixture(scope="session", autouse=True)
def _wandb_kept_local(tmp_path_factory) -> Iterator[None]:
    """No test, nor any subprocess it starts, reaches W&B or the user's W&B files by accident.

    Tests that want W&B set wandb.mode explicitly, which wins over WANDB_MODE. Session-wide, so
    that module-scoped fixtures (one job read by several tests) run under it too.
    """
    wandb_home = tmp_path_factory.getbasetemp() / "wandb_home"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "disabled")
        for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            env.setenv(variable, str(wandb_home))
        yield


@pytest.fixture(scope="session", autouse=True)
def _measurements_kept_local(tmp_path_factory) -> Iterator[None]:
    """No test, nor any subprocess it starts, reads or writes the user's ~/.cache/amp_exp.

    The session's cache holds a probe result in which bf16 and fp16 run far slower than fp32, so
    precision=auto picks fp32 without timing anything, whatever this machine's speed. Tests of the
    probe and of the trial point XDG_CACHE_HOME at their own tmp_path.
    """
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg_cache"))
        inject_probe({"fp32": 1.0, "bf16": 0.05, "fp16": 0.02})
        yield


@pytest.fixture
def compose_cfg() -> Callable[..., DictConfig]:
    """Compose the real config from conf/, shrunk to CPU and a few steps, plus ``overrides``.

    Each caller gets a copy of its own to change (helpers.runs.composed)."""

    def _compose(*overrides: str, fast: bool = True) -> DictConfig:
        return copy.deepcopy(composed((*(FAST if fast else []), *overrides)))

    return _compose


@pytest.fixture
def run_cfg(compose_cfg) -> Callable[..., RunConfig]:
    def _run_cfg(*overrides: str) -> RunConfig:
        return validate(compose_cfg(*overrides))

    return _run_cfg


@pytest.fixture
def override_loss(monkeypatch) -> Callable[[Callable[..., torch.Tensor]], None]:
    """``override_loss(loss_fn)``: tasks built from then on train with ``loss_fn(outputs,
    targets)``, as a fault-injecting test needs (helpers.runs.LossOverride)."""
    return lambda loss_fn: monkeypatch.setattr(workload, "make_task", overriding_loss(loss_fn))


# Another process at a run directory's lock, forked from the warm interpreter
# (helpers/warm_python.py): a process of its own, without the 2 s of CPU a fresh one spends
# importing torch. Each module takes the directory as argv[1].
LOCK_PROBES = {
    # Tries the lock; prints what it got.
    "take_lock": "import sys\nfrom pathlib import Path\n"
    "from amp_exp.results.ownership import RunDirectoryBusy, RunDirectoryLock\n"
    "try:\n    RunDirectoryLock(Path(sys.argv[1])).__enter__(); print('taken')\n"
    "except RunDirectoryBusy as busy:\n    print(busy)\n",
    # Takes the lock, says so, and holds it until killed.
    "hold_lock": "import sys, time\nfrom pathlib import Path\n"
    "from amp_exp.results.ownership import RunDirectoryLock\n"
    "lock = RunDirectoryLock(Path(sys.argv[1])).__enter__()\n"
    "print('held', flush=True)\ntime.sleep(120)\n",
}


class LockElsewhere:
    """``take(directory)``: what another process got trying the lock; ``hold(directory)``:
    another process (a ``WarmProcess``) holding it, until the test kills it."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env

    def take(self, directory) -> str:
        return python_m("take_lock", str(directory), env=self.env, timeout=60).stdout

    def hold(self, directory) -> WarmProcess:
        holder = start_python_m("hold_lock", str(directory), env=self.env, timeout=180)
        deadline = time.monotonic() + 60
        while holder.read_stdout().strip() != "held":
            assert holder.poll() is None and time.monotonic() < deadline, holder.communicate()
            time.sleep(0.01)
        return holder


@pytest.fixture(scope="session")
def lock_elsewhere(tmp_path_factory) -> LockElsewhere:
    folder = tmp_path_factory.mktemp("lock_probes")
    for name, code in LOCK_PROBES.items():
        (folder / f"{name}.py").write_text(code)
    paths = [str(folder), *filter(None, [os.environ.get("PYTHONPATH")])]
    return LockElsewhere({**os.environ, "PYTHONPATH": os.pathsep.join(paths)})


@pytest.fixture
def pngs_not_rasterized(monkeypatch) -> Callable[..., None]:
    """Reports built in this process still draw each plot's figure from their rows, but write a
    stub for its PNG: rasterizing a report's five PNGs costs some 0.6 s of CPU, and only the
    tests of the pictures look at them (they ask for ``real_pngs``). Returns the real writer."""
    from amp_exp.report import plots

    real = plots.save
    monkeypatch.setattr(plots, "save", lambda figure, path: path.write_bytes(b"not rasterized"))
    return real


@pytest.fixture
def real_pngs(pngs_not_rasterized, monkeypatch) -> None:
    """The PNGs rasterized as a report writes them, in a module that stubs them."""
    from amp_exp.report import plots

    monkeypatch.setattr(plots, "save", pngs_not_rasterized)


@pytest.fixture
def amp_exp_here(command_main) -> Callable[..., subprocess.CompletedProcess]:
    """``amp_exp_here(*args)``: ``command_main`` of ``python -m amp_exp args``. For the commands
    the pre-flight refuses, before Hydra starts (a Hydra run here would take over this process's
    logging)."""
    return functools.partial(command_main, "amp_exp")


def _signal_reached_the_test(signum: int, frame: object) -> None:
    raise AssertionError(f"{signal.Signals(signum).name} reached the test, not the command")


@pytest.fixture
def command_main(monkeypatch, capfd):
    """``command_main(command, *args)``: what ``python -m command args`` exits with and prints,
    as a ``subprocess.CompletedProcess``, from the command's ``main`` in this process (the same
    entry point, as ``sys.exit(main())`` ends the process, without 3 s of CPU to start one).

    A preemption signal the command fails to take fails the test instead of ending pytest, and
    the logging Hydra configures for the command goes when it has ended."""

    def run(command: str, *args: str) -> subprocess.CompletedProcess:
        module = importlib.import_module(command)
        if hasattr(module, "__path__"):  # a package: python -m runs its __main__
            module = importlib.import_module(f"{command}.__main__")
        monkeypatch.setattr(sys, "argv", [command, *args])
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level
        previous = {s: signal.signal(s, _signal_reached_the_test) for s in PREEMPTION_SIGNALS}
        try:
            status = module.main()
        except SystemExit as exited:
            status = exited.code
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            for handler in root.handlers:
                if handler not in handlers:
                    handler.close()
            root.handlers[:], root.level = handlers, level
        stdout, stderr = capfd.readouterr()
        return subprocess.CompletedProcess([command, *args], status or 0, stdout, stderr)

    return run


@pytest.fixture(scope="session")
def shared_rank_jobs(tmp_path_factory) -> tuple:
    """``(root, states)``: the two-rank jobs the test modules declared (tests/ddp_jobs.py
    ``declare``), run in one torchrun launch for the session, as ``ddp_jobs.shared_jobs``."""
    from ddp_jobs import shared_jobs

    return shared_jobs(tmp_path_factory)
