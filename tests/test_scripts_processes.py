"""The benchmark scripts that start their sides as processes of their own, and the causal check's:
each script's ``main`` runs in this process, and so does each side it starts, through the same
``main`` with the side's command line: the figures don't matter here, what the sides agree on
does. Apart from tests/test_scripts.py so that pytest-xdist gives the two files two workers."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


class SidesHere:
    """A script's ``subprocess`` for the sides it starts as ``[python, script, *args]``: each
    runs through the script's ``main`` in this process, in the side's directory and with its
    argv, where a process would pay seconds of CPU to import torch and transformers before a
    few steps that take milliseconds. Sides run one after another, as the scripts run them."""

    def run(
        self, command: list[str], cwd: Path | None = None, **_: object
    ) -> subprocess.CompletedProcess:
        python, script, *args = command
        assert python == sys.executable and Path(script).parent == SCRIPTS, command
        side = importlib.import_module(Path(script).stem)
        argv, here = sys.argv, os.getcwd()
        status = 0
        sys.argv = [script, *args]
        os.chdir(cwd or here)
        try:
            with contextlib.redirect_stdout(io.StringIO()) as printed:
                side.main()
        except SystemExit as exited:
            status = exited.code if isinstance(exited.code, int) else 1
        finally:
            sys.argv = argv  # the script builds each side's command from its own argv
            os.chdir(here)
        return subprocess.CompletedProcess(command, status, printed.getvalue(), "")


@pytest.fixture
def run_script(monkeypatch, capsys):
    """``run_script(name, *args)``: the benchmark script's JSON report, from its ``main`` run
    here as ``python scripts/NAME.py ARGS`` would run it."""
    monkeypatch.syspath_prepend(str(SCRIPTS))

    def run(name: str, *args: str) -> dict | list:
        script = importlib.import_module(name)
        monkeypatch.setattr(sys, "argv", [str(SCRIPTS / f"{name}.py"), *args])
        if hasattr(script, "subprocess"):
            monkeypatch.setattr(script, "subprocess", SidesHere())
        script.main()
        return json.loads(capsys.readouterr().out)

    return run


def test_bench_causal_times_the_check_inside_a_run(run_script) -> None:
    tiny = ["trainer.device=cpu", "trainer.max_steps=4", "trainer.timing_warmup_steps=1"]
    lm = ["model=gpt_tiny", "dataset=synthetic_tokens", "dataset.train_size=64"]
    figures = run_script("bench_causal", "--repeats", "1", *tiny, *lm)
    assert figures["status"] == "completed"
    assert 0 < figures["check_s"] < figures["run_wall_s"]
    assert figures["check_warm_median_s"] > 0


def test_parity_trains_a_transformers_model_bit_for_bit_like_a_hand_written_loop(
    run_script,
) -> None:
    pytest.importorskip("transformers")
    report = run_script(
        "bench_parity",
        *("--model", "hf_llama_tiny", "--dataset", "synthetic_tokens"),
        *("--steps", "4", "--warmup", "1", "--rounds", "1", "--batch-size", "4"),
    )
    assert report["state_dicts_identical"] is True and report["steps_timed_per_side"] == 2


def test_the_hf_trainer_benchmark_times_both_sides_by_both_clocks(run_script) -> None:
    pytest.importorskip("accelerate")  # the Trainer's, not amp_exp's
    (row,) = run_script(
        "bench_hf_trainer",
        *("--precisions", "fp32", "--steps", "4", "--warmup", "1", "--rounds", "1"),
        *("--batch-size", "4"),
    )
    assert row["steps_timed_per_side"] == 2
    for clock in ("wall", "cpu"):
        assert row[clock]["amp_exp_tokens_per_s"] > 0 and row[clock]["hf_trainer_tokens_per_s"] > 0
