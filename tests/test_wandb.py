"""W&B logging: the logger against a fake ``wandb`` that records its calls, and one run end to end
through real W&B offline, read back from the run file it writes."""

from __future__ import annotations

import json
import logging
import math
import sys

import pytest
from hydra.types import RunMode
from omegaconf import OmegaConf

from amp_exp.config.schema import WandbMode
from amp_exp.errors import ConfigError, NumericalFault
from amp_exp.results.dashboard import choice_label, run_config, run_group, run_name, run_tags
from amp_exp.results.sweep import SweepJob, sweep_job
from amp_exp.results.wandb_logger import WandbLogger, open_wandb_logger, resolve_mode
from amp_exp.run import train
from helpers.fake_wandb import FakeWandb, install_fake_wandb
from helpers.runs import TINY, inf_loss_at, read_jsonl, signal_self_at_call
from helpers.wandb_records import read_only_run, read_run, run_files

TRAIN_KEYS = {
    "samples",
    "epoch",
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "amp/scale",
    "amp/scale_mean",
    "amp/skipped_steps",
    "amp/skip_rate",
    "perf/samples_per_s",
    "perf/step_time_ms",
    "perf/peak_mem_bytes",
}
EVAL_KEYS = {"eval/loss", "eval/acc"}


def test_fp16_run_logs_every_key_at_its_steps_and_the_scale_falls_on_overflow(
    override_loss, run_cfg, tmp_path
) -> None:
    # The audit on the untimed first step: the first row's interval then has a timed step.
    cfg = run_cfg(
        "precision=fp16",
        "precision.init_scale=1024",
        "wandb.mode=offline",
        "diagnostics.audit_step=1",
        *TINY,
    )
    override_loss(inf_loss_at({3}))
    summary = train(cfg, tmp_path)
    run = read_only_run(tmp_path)
    assert run.kinds[-1] == "exit"  # finished, and the file is complete
    assert [row["_step"] for row in run.history] == [2, 4]
    assert all(row.keys() >= TRAIN_KEYS for row in run.history)
    assert EVAL_KEYS.isdisjoint(run.history[0]) and run.history[1].keys() >= EVAL_KEYS
    assert [row["amp/scale"] for row in run.history] == [1024.0, 512.0]
    assert [row["amp/scale_mean"] for row in run.history] == [1024.0, 512.0]
    assert [row["amp/skipped_steps"] for row in run.history] == [0, 1]
    assert [row["amp/skip_rate"] for row in run.history] == [0.0, 0.5]
    train_rows = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    # The forced overflow makes the second interval's loss infinite; JSON lines write null.
    assert run.history[0]["train/loss"] == train_rows[0]["loss"]
    assert run.history[1]["train/loss"] == math.inf and train_rows[1]["loss"] is None
    assert [row["samples"] for row in run.history] == [32, 64]
    assert run.summary["amp/scale"] == {"last": summary["loss_scale"]}
    assert run.summary["amp/skipped_steps"] == {"last": summary["skipped_steps"]}
    assert run.summary["perf/samples_per_s"] == {"last": train_rows[-1]["samples_per_s"]}
    assert run.summary["perf/peak_mem_bytes"] == {"max": train_rows[-1]["peak_mem_bytes"]}
    assert run.summary["eval/acc"] == summary["eval_acc"]
    for pattern in ("train/*", "amp/*", "perf/*", "eval/*"):
        assert run.metrics[pattern].step_metric == "samples"
    # W&B itself honours the settings that keep metadata (command line, host) and code home.
    assert run.environments == []
    assert not list(tmp_path.glob("wandb/*/files/code")) and not list(tmp_path.rglob("*.patch"))


def test_a_run_is_named_tagged_and_configured_and_its_id_kept_beside_its_results(
    run_cfg, tmp_path, monkeypatch
) -> None:
    fake = install_fake_wandb(monkeypatch)
    train(run_cfg("precision=bf16", "wandb.mode=offline", "wandb.tags=[baseline]"), tmp_path)
    (init,) = fake.called("init")
    assert (init["mode"], init["name"], init["group"], init["job_type"]) == (
        "offline",
        "tiny_cnn-bf16-s0",
        None,
        "train",
    )
    assert (init["project"], init["dir"], init["reinit"]) == (
        "amp_exp",
        str(tmp_path),
        "finish_previous",
    )
    assert init["tags"] == ["tiny_cnn", "bf16", "synthetic", "cpu", "baseline"]
    config = init["config"]
    assert config["precision.name"] == "bf16" and config["precision.resolved"] == "bf16"
    assert config["precision.init_scale"] == 65536.0
    assert config["model"] == {"name": "tiny_cnn", "width": 32, "normalize_features": False}
    assert "precision" not in config and "wandb" not in config
    assert "id" not in init and "resume" not in init  # a fresh start is a new W&B run
    assert (tmp_path / "wandb_run_id").read_text() == fake.run.id
    assert fake.run.exit_code == 0 and fake.called("teardown") == [{}]


@pytest.mark.parametrize("save", [False, True])
def test_code_and_metadata_are_uploaded_only_when_turned_on(
    run_cfg, tmp_path, monkeypatch, save
) -> None:
    fake = install_fake_wandb(monkeypatch)
    cfg = run_cfg("wandb.mode=offline", f"wandb.save_code={save}", f"wandb.save_metadata={save}")
    assert open_wandb_logger(cfg, tmp_path, "fp32", "cpu", 4, None) is not None
    settings = fake.settings
    assert (settings.save_code, settings.x_save_requirements) == (save, save)
    assert (settings.disable_code, settings.disable_git) == (not save, not save)
    # W&B's metadata holds the command line, the program path, the host and the user name.
    assert settings.x_disable_meta is not save
    assert (settings.mode, settings.silent) == ("offline", True)


def test_a_log_that_raises_is_reported_once_and_training_goes_on(
    run_cfg, tmp_path, monkeypatch, caplog
) -> None:
    fake = install_fake_wandb(monkeypatch, raises={"log": RuntimeError("the service went away")})
    with caplog.at_level(logging.WARNING, logger="amp_exp"):
        summary = train(run_cfg("wandb.mode=offline", "trainer.max_steps=6"), tmp_path)
    assert summary["steps"] == 6
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [2, 4, 6]
    assert [r["step"] for r in rows if "eval_acc" in r] == [6]
    warnings = [r.getMessage() for r in caplog.records if "W&B" in r.getMessage()]
    assert len(warnings) == 1
    assert "could not log step 2" in warnings[0] and "went away" in warnings[0]
    assert [call["step"] for call in fake.called("log")] == [2]  # no retry on every row
    assert fake.called("summary.update") == []  # nor for the summary after a failure
    assert fake.run.exit_code == 0 and len(fake.called("teardown")) == 1


def test_a_finish_that_raises_is_reported_and_w_and_b_still_shut_down(caplog) -> None:
    fake = FakeWandb(raises={"finish": RuntimeError("timed out")})
    logger = WandbLogger(fake, fake.init(mode="offline"), log_every=None, total_steps=4)
    with caplog.at_level(logging.WARNING, logger="amp_exp"):
        logger.close()
    assert [r.getMessage() for r in caplog.records] == [
        "W&B: could not finish the run (RuntimeError: timed out); W&B logging stops here, "
        "metrics.jsonl has every row"
    ]
    assert len(fake.called("teardown")) == 1


def test_wandb_log_every_thins_train_rows_and_keeps_the_last() -> None:
    fake = FakeWandb()
    run = fake.init(mode="offline")
    logger = WandbLogger(fake, run, log_every=4, total_steps=10)
    for step, skipped in [(2, 1), (4, 1), (6, 1), (8, 3), (10, 3)]:
        logger.log({"kind": "train", "step": step, "loss": 1.0, "skipped_steps": skipped})
    logger.log({"kind": "eval", "step": 10, "samples": 40, "eval_loss": 2.0, "eval_acc": 0.5})
    assert [call["step"] for call in fake.called("log")] == [4, 8, 10, 10]
    assert [row["amp/skip_rate"] for row in run.history] == [0.25, 0.5, 0.0]
    assert all("amp/scale" not in row for row in run.history)  # no scale outside fp16
    assert fake.called("log")[-1]["metrics"] == {"samples": 40, "eval/loss": 2.0, "eval/acc": 0.5}


def test_every_metric_group_is_plotted_against_samples() -> None:
    fake = FakeWandb()
    run = fake.init(mode="offline")
    WandbLogger(fake, run, log_every=None, total_steps=4)
    assert run.metrics["samples"] == {}
    for pattern in ("train/*", "amp/*", "perf/*", "eval/*"):
        assert run.metrics[pattern]["step_metric"] == "samples"
    assert run.metrics["amp/scale"] == {"step_metric": "samples", "summary": "last"}
    assert run.metrics["perf/peak_mem_bytes"] == {"step_metric": "samples", "summary": "max"}


def test_disabled_never_imports_wandb(run_cfg, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # any import of wandb would now fail
    monkeypatch.setenv("WANDB_MODE", "disabled")
    for mode in ("disabled", "auto"):
        cfg = run_cfg(f"wandb.mode={mode}")
        assert open_wandb_logger(cfg, tmp_path, "fp32", "cpu", 4, None) is None
    assert not (tmp_path / "wandb").exists()


@pytest.mark.parametrize(
    ("configured", "environ", "expected"),
    [
        ("auto", {}, "auto"),
        ("auto", {"WANDB_MODE": "offline"}, "offline"),
        ("auto", {"WANDB_MODE": "dryrun"}, "offline"),
        ("auto", {"WANDB_MODE": "Disabled"}, "disabled"),
        ("auto", {"WANDB_MODE": "run"}, "online"),
        ("online", {"WANDB_MODE": "disabled"}, "online"),
        ("disabled", {"WANDB_MODE": "online"}, "disabled"),
    ],
)
def test_wandb_mode_env_decides_only_under_auto(configured, environ, expected) -> None:
    assert resolve_mode(WandbMode(configured), environ) is WandbMode(expected)


def test_an_unknown_wandb_mode_env_is_one_line_error() -> None:
    with pytest.raises(ConfigError, match="WANDB_MODE=sideways is not a W&B mode"):
        resolve_mode(WandbMode.auto, {"WANDB_MODE": "sideways"})


def test_names_groups_and_tags(run_cfg) -> None:
    cfg = run_cfg("model=mlp", "seed=3", "wandb.tags=[mlp,night]")
    sweep = SweepJob("outputs/multirun/d/t", (("optimizer.lr", "0.01"), ("seed", "3")))
    assert run_name(cfg, "bf16", None) == "mlp-bf16-s3"
    assert run_name(cfg, "bf16", sweep) == "mlp-bf16-lr0.01-s3"
    assert run_group(cfg, None) is None and run_group(cfg, sweep) == "outputs/multirun/d/t"
    assert run_tags(cfg, "bf16", "cuda") == ["mlp", "bf16", "synthetic", "cuda", "night"]
    named = run_cfg("wandb.name=mine", "wandb.group=g")
    assert (run_name(named, "fp32", sweep), run_group(named, sweep)) == ("mine", "g")
    assert choice_label("optimizer", "adamw") == "adamw"
    assert choice_label("dataset.batch_size", "64") == "batch_size64"


def test_config_is_plain_with_precision_flat(run_cfg) -> None:
    config = run_config(run_cfg("precision=fp16", "optimizer=adamw"), "fp16")
    assert json.loads(json.dumps(config)) == config  # plain types only, enums as values
    assert config["optimizer"]["betas"] == [0.9, 0.999]
    assert {k for k in config if k.startswith("precision.")} == {
        "precision.name",
        "precision._target_",
        "precision.options",
        "precision.init_scale",
        "precision.growth_factor",
        "precision.backoff_factor",
        "precision.growth_interval",
        "precision.clip_grad_norm",
        "precision.max_consecutive_skips",
        "precision.min_scale",
        "precision.emulate",
        "precision.reduce_dtype",
        "precision.fsdp_cast_params",
        "precision.keep_fp32",
        "precision.resolved",
    }


def test_config_says_which_strategy_ran_and_its_dtypes(run_cfg) -> None:
    cfg = run_cfg("trainer.strategy=fsdp2", "precision=bf16")
    parallelism = {"strategy": "fsdp2", "param_dtype": "bf16", "reduce_dtype": "fp32"}
    config = run_config(cfg, "bf16", parallelism)
    assert config["strategy"] == "fsdp2"
    # precision.reduce_dtype=null (from the precision) becomes the dtype it resolved to.
    assert (config["precision.param_dtype"], config["precision.reduce_dtype"]) == ("bf16", "fp32")


def test_a_sweep_job_knows_its_sweep_and_what_it_varies(tmp_path) -> None:
    OmegaConf.save(
        {"hydra": {"overrides": {"task": ["optimizer.lr=0.1,0.01", "model=mlp", "seed=0,1"]}}},
        tmp_path / "multirun.yaml",
    )
    job = OmegaConf.create(
        {
            "mode": RunMode.MULTIRUN,
            "runtime": {"cwd": str(tmp_path.parent)},
            "sweep": {"dir": tmp_path.name},
            "overrides": {"task": ["optimizer.lr=0.01", "model=mlp", "seed=1"]},
        }
    )
    assert sweep_job(job) == SweepJob(tmp_path.name, (("optimizer.lr", "0.01"), ("seed", "1")))
    assert sweep_job(OmegaConf.create({"mode": RunMode.RUN})) is None


def test_a_preset_sweep_job_knows_what_it_varies(tmp_path) -> None:
    # Presets (conf/experiment/) sweep through hydra.sweeper.params, not the command line.
    OmegaConf.save(
        {
            "hydra": {
                "overrides": {"task": ["experiment=init_scale_sweep", "seed=0,1"]},
                "sweeper": {"params": {"precision.init_scale": "1024,65536"}},
            }
        },
        tmp_path / "multirun.yaml",
    )
    job = OmegaConf.create(
        {
            "mode": RunMode.MULTIRUN,
            "runtime": {"cwd": str(tmp_path.parent)},
            "sweep": {"dir": tmp_path.name},
            "overrides": {
                "task": ["precision.init_scale=1024", "experiment=init_scale_sweep", "seed=1"]
            },
        }
    )
    assert sweep_job(job).choices == (("precision.init_scale", "1024"), ("seed", "1"))


def test_the_record_reader_follows_records_across_blocks(tmp_path) -> None:
    import wandb

    run = wandb.init(mode="offline", dir=tmp_path, settings=wandb.Settings(silent=True))
    for step in range(1, 1001):
        run.log({"x": step}, step=step)
    run.log({"long": "z" * 80_000}, step=1001)  # one record over several 32 KiB blocks
    run.finish()
    wandb.teardown()
    (path,) = run_files(tmp_path)
    assert path.stat().st_size > 3 * 32 * 1024
    history = read_run(path).history
    assert [row["_step"] for row in history] == list(range(1, 1002))
    assert [row["x"] for row in history[:-1]] == list(range(1, 1001))
    assert len(history[-1]["long"]) == 80_000


def test_a_resumed_run_continues_the_same_wandb_run(
    override_loss, run_cfg, tmp_path, monkeypatch
) -> None:
    fake = install_fake_wandb(monkeypatch)
    overrides = ("wandb.mode=offline", "trainer.max_steps=6", *TINY)
    override_loss(signal_self_at_call(3))
    train(run_cfg(*overrides), tmp_path)
    train(run_cfg(*overrides, "resume=auto"), tmp_path)
    first, second = fake.runs
    assert "id" not in fake.called("init")[0]
    assert (fake.called("init")[1]["id"], fake.called("init")[1]["resume"]) == (first.id, "allow")
    assert second.id == first.id == (tmp_path / "wandb_run_id").read_text()
    assert [row["_step"] for row in first.history] == [2]
    assert [row["_step"] for row in second.history] == [4, 6]


def test_amp_health_reaches_the_wandb_summary(
    override_loss, run_cfg, tmp_path, monkeypatch
) -> None:
    fake = install_fake_wandb(monkeypatch)
    cfg = run_cfg("precision=fp16", "wandb.mode=offline", "diagnostics.underflow_every=2", *TINY)
    override_loss(inf_loss_at({3}))
    summary = train(cfg, tmp_path)
    run = fake.run
    assert run.summary["amp/checks_passed"] is True
    assert run.summary["amp/first_overflow_step"] == 3
    assert run.summary["amp/suggested_init_scale"] == summary["suggested_init_scale"]
    assert run.summary["perf/state_bytes"] == summary["state_bytes"]
    underflow_rows = [row for row in run.history if "amp/grad_underflow_frac" in row]
    assert [row["_step"] for row in underflow_rows] == [2, 4]


def test_the_precision_audit_reaches_the_summary_and_a_table(run_cfg, tmp_path, monkeypatch):
    fake = install_fake_wandb(monkeypatch)
    summary = train(run_cfg("precision=bf16", "wandb.mode=offline", *TINY), tmp_path)
    audit, run = summary["precision_audit"], fake.run
    assert run.summary["audit/engaged"] is True
    assert run.summary["audit/flops_share/bfloat16"] == 1.0
    assert run.summary["audit/matmul_flops"] == audit["matmul_flops"]
    saved = audit["saved_activation_bytes"]["total"]
    assert run.summary["audit/saved_activation_bytes"] == saved
    (table_row,) = [row for row in run.history if "audit/matmuls" in row]
    assert table_row["_step"] == summary["steps"]  # beside the last row: W&B's steps only grow
    table = table_row["audit/matmuls"]
    assert table.columns == ["module", "dtype", "flops", "share"]
    assert {(module, dtype) for module, dtype, _, _ in table.data} == {
        ("features.0", "bfloat16"),
        ("features.3", "bfloat16"),
        ("head", "bfloat16"),
    }
    assert sum(flops for _, _, flops, _ in table.data) == audit["matmul_flops"]


def test_a_table_w_and_b_refuses_costs_the_run_nothing(run_cfg, tmp_path, monkeypatch) -> None:
    fake = install_fake_wandb(monkeypatch, raises={"Table": ValueError("bad table")})
    summary = train(run_cfg("wandb.mode=offline", *TINY), tmp_path)
    assert summary["status"] == "completed" and fake.run.exit_code == 0


def test_a_run_that_raises_is_marked_failed_on_wandb(
    override_loss, run_cfg, tmp_path, monkeypatch
) -> None:
    fake = install_fake_wandb(monkeypatch)
    cfg = run_cfg("trainer.on_nonfinite=stop", "wandb.mode=offline", *TINY)
    with pytest.raises(NumericalFault):
        override_loss(inf_loss_at({2}))
        train(cfg, tmp_path)
    assert fake.run.exit_code == 1
    assert len(fake.called("teardown")) == 1


def test_online_with_a_key_logs_online_and_never_prompts(run_cfg, tmp_path, monkeypatch, caplog):
    fake = install_fake_wandb(monkeypatch, has_key=True)
    with caplog.at_level(logging.INFO, logger="amp_exp"):
        open_wandb_logger(run_cfg("wandb.mode=online"), tmp_path, "fp32", "cpu", 4, None)
    assert fake.called("login") == [{"prompt": False, "verify": False}]
    assert [init["mode"] for init in fake.called("init")] == ["online"]
    assert fake.settings.mode == "online"
    assert [r.getMessage() for r in caplog.records] == [f"W&B: logging online to {fake.run.url}"]


@pytest.mark.parametrize(("mode", "level"), [("online", logging.WARNING), ("auto", logging.INFO)])
def test_without_a_key_a_run_falls_back_offline_and_warns_only_if_online_was_asked(
    run_cfg, tmp_path, monkeypatch, caplog, mode, level
) -> None:
    fake = install_fake_wandb(monkeypatch, has_key=False)
    monkeypatch.delenv("WANDB_MODE")
    with caplog.at_level(logging.INFO, logger="amp_exp"):
        logger = open_wandb_logger(run_cfg(f"wandb.mode={mode}"), tmp_path, "fp32", "cpu", 4, None)
    assert logger is not None and logger.run is fake.run
    assert [init["mode"] for init in fake.called("init")] == ["offline"]
    sync_dir = fake.run.settings.sync_dir
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            level,
            "W&B: no API key is configured (set WANDB_API_KEY or run `wandb login`), so logging "
            f"offline to {sync_dir}; upload it later with `wandb sync {sync_dir}`",
        )
    ]


def test_an_online_start_that_raises_falls_back_offline_with_a_warning(
    run_cfg, tmp_path, monkeypatch, caplog
) -> None:
    fake = install_fake_wandb(monkeypatch, raises={"init:online": TimeoutError("no answer")})
    with caplog.at_level(logging.WARNING, logger="amp_exp"):
        logger = open_wandb_logger(run_cfg("wandb.mode=online"), tmp_path, "fp32", "cpu", 4, None)
    assert logger is not None and logger.run.mode == "offline"
    assert [init["mode"] for init in fake.called("init")] == ["online", "offline"]
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith("W&B: could not start online (TimeoutError: no answer), so logging")


def test_when_w_and_b_cannot_start_at_all_training_goes_on_without_it(
    run_cfg, tmp_path, monkeypatch, caplog
) -> None:
    fake = install_fake_wandb(monkeypatch, raises={"setup": RuntimeError("bad settings")})
    with caplog.at_level(logging.WARNING, logger="amp_exp"):
        summary = train(run_cfg("wandb.mode=offline"), tmp_path)
    assert summary["steps"] == 4 and (tmp_path / "summary.json").is_file()
    assert fake.runs == [] and not (tmp_path / "wandb_run_id").exists()
    warnings = [r.getMessage() for r in caplog.records if "W&B" in r.getMessage()]
    assert warnings == [
        "W&B: could not start a run (RuntimeError: bad settings); training goes on without it"
    ]
