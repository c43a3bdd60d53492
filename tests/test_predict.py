"""python -m amp_exp.predict: the traced step counts what a GPU would run, the roofline orders
precisions and models as published measurements do (the bands published.json states around
its rows: tests/test_predict_published.py)."""

from __future__ import annotations

import copy
import json
import math

import pytest

from amp_exp.config.schema import RunConfig
from amp_exp.config.values import validate
from amp_exp.devices import PREDICTABLE
from amp_exp.errors import ConfigError
from amp_exp.predict.predict import predict_trace
from amp_exp.predict.trace import StepTrace, trace_step
from amp_exp.results.files import PREDICT_JSON, PREDICT_MD
from helpers.runs import FAST_TRAINER, composed

TINY_LM = ["model=gpt_tiny", "dataset=synthetic_tokens"]


def llama(hidden: int, intermediate: int, layers: int, heads: int, seq_len: int) -> list[str]:
    return [
        "model=hf",
        "model.name=llama",
        f"+model.config.hidden_size={hidden}",
        f"+model.config.intermediate_size={intermediate}",
        f"+model.config.num_hidden_layers={layers}",
        f"+model.config.num_attention_heads={heads}",
        "+model.config.num_key_value_heads=8",
        "+model.config.vocab_size=128256",
        f"+model.config.max_position_embeddings={seq_len}",
        "dataset=synthetic_tokens",
        f"dataset.seq_len={seq_len}",
        "dataset.batch_size=1",
        "optimizer=adamw",
    ]


def row(found: dict, precision: str, device: str = "h100") -> dict:
    return found["devices"][device]["precisions"][precision]


def config(*overrides: str) -> RunConfig:
    return validate(copy.deepcopy(composed((*FAST_TRAINER, *overrides))))


@pytest.fixture(scope="module")
def tiny_trace() -> tuple[RunConfig, StepTrace]:
    """gpt_tiny's step, traced once for the module (its config and trace)."""
    cfg = config(*TINY_LM, "optimizer=adamw", "predict.devices=[h100,a100]")
    return cfg, trace_step(cfg)


def test_the_trace_counts_every_linear_matmul_three_times_and_attention_causally(
    tiny_trace,
) -> None:
    """Caught: a backward matmul lost (4N instead of 6N), attention's T x T scores counted as
    the math path's bmm and softmax, or causal attention counted whole."""
    cfg, trace = tiny_trace
    tokens = trace.batch_size * trace.units_per_sample
    linear = sum(op.flops for op in trace.ops if op.linear is not None)
    assert linear == 6 * sum(trace.linear_weights.values()) * tokens
    attention = sum(op.flops for op in trace.ops if "flash_attention" in op.name)
    model = cfg.model
    head_dim = model.d_model // model.n_head
    # Per token and layer, flash's 2 matmuls of 2 H Q T FLOPs forward and 5 backward (it
    # recomputes the scores), half of each under the causal mask: 7 H Q T, not the 12 H Q T of
    # tasks/flops.py's non-causal formula without the recompute.
    assert attention == 7 * model.n_layer * model.n_head * head_dim * model.seq_len * tokens
    assert not any(op.name in {"bmm", "_softmax", "_safe_softmax"} for op in trace.ops)


def test_saved_activations_grow_with_the_batch_and_leave_the_weights_out() -> None:
    """Caught: parameters counted as saved activations (then doubling the batch would not double
    the count), or views of one tensor counted once per view."""
    small = trace_step(config(*TINY_LM, "dataset.batch_size=4"))
    large = trace_step(config(*TINY_LM, "dataset.batch_size=8"))
    assert large.saved_elements == 2 * small.saved_elements
    # Less one element: the loss's scalar total weight, saved once whatever the batch.
    assert large.saved_fp32_elements == 2 * small.saved_fp32_elements - 1


def test_activation_checkpointing_recomputes_the_blocks_and_keeps_their_inputs(tiny_trace) -> None:
    """As the run wraps them (tasks/blocks.py): a block's linears run their forward again in
    the backward, the head's does not; far fewer elements are saved. Caught: the setting
    ignored, or the block inputs a checkpoint keeps left out (then nothing of the blocks would
    be saved)."""
    _, plain = tiny_trace
    cfg = config(*TINY_LM, "optimizer=adamw", "trainer.activation_checkpointing=true")
    checkpointed = trace_step(cfg)
    tokens = plain.batch_size * plain.units_per_sample
    head = plain.linear_weights["lm_head"]
    blocks = sum(plain.linear_weights.values()) - head
    linear = sum(op.flops for op in checkpointed.ops if op.linear is not None)
    # torch's checkpoint stops recomputing once every saved tensor is back, so a block's last
    # linear does not rerun: between 6 and 8 FLOPs per weight and token.
    assert (6 * blocks + 6 * head) * tokens < linear < (8 * blocks + 6 * head) * tokens
    d_model = cfg.model.d_model
    block_inputs = cfg.model.n_layer * tokens * d_model
    assert block_inputs <= checkpointed.saved_elements < plain.saved_elements / 2


def test_gpt_tiny_gains_under_10_percent_from_fp8_on_h100(tiny_trace) -> None:
    """The published ordering's small end: a 64-wide model's step is kernel launches and
    memory-bound ops, which fp8 does not speed up and its quantization adds to. Both compiled
    (trainer.compile=true): auto compiles fp8 alone, and compile's fewer launches would be
    credited to fp8. Caught: fp8's 2x matmul rate applied to the whole step."""
    _, trace = tiny_trace
    cfg = config(*TINY_LM, "optimizer=adamw", "trainer.compile=true")
    fp8 = row(predict_trace(cfg, trace), "fp8")
    assert fp8["speedup_vs_bf16"] < 1.10
    assert fp8["bound_share"].get("compute", 0.0) < 0.1
    assert any(op["op"] == "fp8 quantization" for op in fp8["top_ops"])


def test_a_larger_model_gains_more_from_fp8(tiny_trace) -> None:
    """Two layers at Llama-3 8B's and 70B's widths: the wider a linear, the more of the step is
    its matmuls, which fp8 halves (the whole models, docs/hardware.md). Both precisions compiled
    (trainer.compile=true), so the speedup is fp8's alone, not compile's fusion, which auto gives
    fp8 only. Caught: a speedup that ignores shapes (flat across models)."""
    _, trace = tiny_trace
    tiny = config(*TINY_LM, "optimizer=adamw", "trainer.compile=true")
    gains = [row(predict_trace(tiny, trace), "fp8")["speedup_vs_bf16"]]
    for widths in ((4096, 14336, 32), (8192, 28672, 64)):
        wide = config(*llama(*widths[:2], 2, widths[2], 1024), "trainer.compile=true")
        gains.append(row(predict_trace(wide, trace_step(wide)), "fp8")["speedup_vs_bf16"])
    assert gains == sorted(gains) and len(set(gains)) == 3, gains
    assert gains[0] < 1 < gains[-1]


def test_memory_follows_the_precision_table(tiny_trace) -> None:
    """fp32 master weights and AdamW's two fp32 moments in every autocast mode; pure bf16 halves
    all three. Caught: a weight dtype taken from the compute dtype (bf16's masters as 2 bytes)."""
    cfg, trace = tiny_trace
    n = trace.parameters
    found = predict_trace(cfg, trace)
    assert row(found, "bf16")["memory_bytes"]["weights"] == 4 * n
    assert row(found, "bf16")["memory_bytes"]["optimizer"] == 8 * n
    assert (
        row(found, "bf16")["memory_bytes"]["activations"]
        < row(found, "fp32")["memory_bytes"]["activations"]
    )
    pure = config(*TINY_LM, "optimizer=adamw", "predict.precisions=[bf16_true]")
    memory = row(predict_trace(pure, trace), "bf16_true")["memory_bytes"]
    assert memory["weights"] == memory["grads"] == 2 * n
    assert memory["optimizer"] == 4 * n


def test_the_largest_batch_fills_the_device(tiny_trace) -> None:
    """Caught: the static state counted once per sample, or the activations not at all."""
    cfg, trace = tiny_trace
    found = row(predict_trace(cfg, trace), "bf16")
    memory = found["memory_bytes"]
    per_sample = memory["activations"] / trace.batch_size
    static = memory["weights"] + memory["grads"] + memory["optimizer"]
    usable = 0.9 * PREDICTABLE["h100"].memory_gb * 1e9
    assert (
        static + found["max_batch"] * per_sample
        <= usable
        < static + (found["max_batch"] + 1) * per_sample
    )


def test_fsdp2_shards_the_state_and_pays_for_its_collectives(tiny_trace) -> None:
    """Caught: predict.world_size ignored, or its collectives free."""
    _, trace = tiny_trace
    alone = row(predict_trace(config(*TINY_LM, "optimizer=adamw"), trace), "bf16")
    eight = row(
        predict_trace(config(*TINY_LM, "optimizer=adamw", "predict.world_size=8"), trace), "bf16"
    )
    assert eight["memory_bytes"]["weights"] == math.ceil(trace.parameters / 8) * 4
    assert eight["bound_share"]["network"] > 0
    assert eight["step_time_s"] > alone["step_time_s"] - 1e-12


def test_a_device_without_fp8_is_not_predicted_for_it(tiny_trace) -> None:
    cfg, trace = tiny_trace
    found = row(predict_trace(cfg, trace), "fp8", "a100")
    assert found["supported"] is False and found["fits"] is True
    assert found["why"] == "no hardware support: A100 has no fp8 Tensor Cores"
    assert found["step_time_s"] is None and found["speedup_vs_bf16"] is None


def test_the_device_table_holds_dense_figures_with_their_sources() -> None:
    """Caught: a sparse figure copied in (twice the dense one), or a device without memory."""
    for device in PREDICTABLE.values():
        assert device.hbm_tb_per_s and device.memory_gb and device.memory_source
        assert {"fp32", "bf16", "tf32"} <= set(device.tflops)
        if "fp8" in device.tflops:
            assert device.tflops["fp8"] == pytest.approx(2 * device.tflops["bf16"], rel=0.01)
    assert PREDICTABLE["h100"].tflops["bf16"] == 989


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "predict.devices=[h900]",
            "h900 is not in the device table; valid choices: a100, h100, h200, b200",
        ),
        ("predict.precisions=[auto]", "valid choices: fp32"),
        ("predict.world_size=0", "predict.world_size=0 must be 1 or more"),
    ],
)
def test_bad_predict_values_name_the_valid_choices(override, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        config(*TINY_LM, override)


@pytest.mark.slow
def test_the_command_writes_its_files_and_refuses_to_overwrite_them(tmp_path, command_main) -> None:
    """Through the command's entry point, in this process: its exit statuses and files."""
    run_dir = tmp_path / "predict"
    args = [
        *TINY_LM,
        "trainer.device=cpu",
        "predict.devices=[h100,b200]",
        f"hydra.run.dir={run_dir}",
    ]
    result = command_main("amp_exp.predict", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads((run_dir / PREDICT_JSON).read_text())
    for device in ("h100", "b200"):
        for precision in ("fp32", "bf16", "fp8"):
            entry = found["devices"][device]["precisions"][precision]
            assert {
                "step_time_s",
                "speedup_vs_bf16",
                "speedup_vs_fp32",
                "max_batch",
                "top_ops",
            } <= set(entry)
            assert set(entry["memory_bytes"]) == {"weights", "grads", "optimizer", "activations"}
    assert "a roofline, not a measurement" in (run_dir / PREDICT_MD).read_text()
    again = command_main("amp_exp.predict", *args)
    assert again.returncode == 2
    assert "pass --force to replace them" in again.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("pngs_not_rasterized")  # read for its words (conftest)
def test_a_sweep_report_shows_the_prediction_beside_the_measured_trial(
    tmp_path, amp_exp_here
) -> None:
    """``report.predict=[h100,a100]``: the sweep's report adds a column per GPU, each figure
    labelled as predicted and equal to what python -m amp_exp.predict gives for the same run.
    Caught: a prediction shown without its label, or one that is not the command's (a trace of
    another config, a speedup against the wrong baseline, GPUs swapped). The sweep runs through
    the entry point, in this process."""
    sweep_dir = tmp_path / "sweep"
    result = amp_exp_here(
        "-m",
        *TINY_LM,
        *FAST_TRAINER,
        "optimizer=adamw",
        "precision=fp32,bf16",
        "report.speed_trial=false",
        "report.predict=[h100,a100]",
        f"hydra.sweep.dir={sweep_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((sweep_dir / "report.json").read_text())
    (found,) = report["comparisons"]
    # The same run's config through the command's own code path: one fact, one figure.
    run_config = json.loads((sweep_dir / "1" / "summary.json").read_text())["config"]
    from amp_exp.config.plain import run_config_from_plain

    cfg = run_config_from_plain(run_config)
    cfg.predict.devices = ["h100", "a100"]
    expected = predict_trace(cfg, trace_step(cfg))
    for key in ("h100", "a100"):
        gpu = PREDICTABLE[key].label
        predicted = found["predicted"][gpu]["speedup_vs_fp32"]
        assert predicted == pytest.approx(row(expected, "bf16", key)["speedup_vs_fp32"], rel=1e-9)
    # The GPUs differ (catches one GPU's figure shown under both).
    assert len({p["speedup_vs_fp32"] for p in found["predicted"].values()}) == 2
    markdown = (sweep_dir / "report.md").read_text()
    h100 = PREDICTABLE["h100"].label
    assert f"predicted on {h100}" in markdown
    assert f"{found['predicted'][h100]['speedup_vs_fp32']:.2f}x (predicted)" in markdown
    assert "a prediction, not a measurement" in markdown


def test_report_predict_names_the_valid_devices() -> None:
    with pytest.raises(ConfigError, match=r"report\.predict: h900 is not in the device table"):
        config(*TINY_LM, "report.predict=[h900]")
