"""AMP health: measured hardware verdicts and advice, the doctor, the automated checklist,
underflow, first-overflow forensics."""

from __future__ import annotations

import json
import math

import pytest
import torch

import amp_exp.capability.probe
import amp_exp.capability.rounds
import amp_exp.doctor
from amp_exp.capability.auto import CACHE_FILE as AUTO_CACHE_FILE
from amp_exp.capability.cache import read_entries, write_entries
from amp_exp.capability.device import trial_verdict
from amp_exp.run import build, train
from amp_exp.tasks.vision_models import l2_normalize_function
from amp_exp.training.diagnostics import FP16_MAX, gradient_ranges, largest_safe_scale
from helpers.probes import inject_probe, short_trials, timing_at
from helpers.runs import TINY, read_jsonl

CPU = torch.device("cpu")
fp32, bf16, fp16 = "fp32", "bf16", "fp16"


def warning(
    precision: str, factor: str, instead: str, kernels: str = "matmul and conv and attention"
) -> list[str]:
    return [
        f"the probe's {kernels} kernels ran {precision} about {factor} slower than fp32 here: "
        f"use precision={instead}"
    ]


def test_run_records_hardware_and_warns_once_with_the_measured_factor(
    run_cfg, tmp_path, caplog
) -> None:
    # The session's probe (conftest): bf16 runs at 0.05x and fp16 at 0.02x fp32's speed.
    summary = train(run_cfg("precision=fp16", *TINY), tmp_path)
    hardware = summary["hardware"]
    assert hardware["device"] == "cpu"
    assert hardware["recommended"] == "fp32"
    assert "relative_speed" not in hardware["measured"]["fp16"]  # the probe's is no speed answer
    assert hardware["measured_peak_tflops"] == pytest.approx(0.02)
    assert hardware["advice"] == warning("fp16", "50x", "fp32", kernels="conv")
    assert caplog.text.count(hardware["advice"][0]) == 1


def test_the_probes_advice_prints_once_per_sweep_and_once_per_single_run(
    run_cfg, tmp_path, caplog
) -> None:
    """Issue 37: "bf16 measured about 1.20x slower than fp32 here" printed once per job: six
    times in a clean sweep. Hydra's local launcher runs a sweep's jobs in one process."""
    from amp_exp.results.sweep import SweepJob
    from amp_exp.runtime.quiet import quiet_unactionable

    quiet_unactionable()
    sweep = SweepJob(str(tmp_path / "sweep"), ())
    for seed in (0, 1):
        cfg = run_cfg("precision=fp16", *TINY, f"seed={seed}")
        advice = train(cfg, tmp_path / "sweep" / str(seed), sweep=sweep)["hardware"]["advice"]
    assert advice and caplog.text.count(advice[0]) == 1
    caplog.clear()
    for seed in (0, 1):  # single runs, each its own: each says it
        train(run_cfg("precision=fp16", *TINY, f"seed={seed}"), tmp_path / "single" / str(seed))
    assert caplog.text.count(advice[0]) == 2


def test_underflow_fraction_follows_the_loss_scale() -> None:
    grads = [("layer", torch.full((1000,), 1e-5))]
    tiny_totals, _, _ = gradient_ranges(grads, scale=2.0**-10)
    sane_totals, worst, max_abs = gradient_ranges(grads, scale=2.0**16)
    assert tiny_totals["underflow_frac_scaled"] == 1.0
    assert sane_totals["underflow_frac_scaled"] == 0.0
    assert sane_totals["underflow_frac"] == 0.0  # 1e-5 is above fp16's smallest subnormal
    assert worst[0]["layer"] == "layer"
    assert max_abs == pytest.approx(1e-5)
    overflow_totals, _, _ = gradient_ranges(grads, scale=2.0**33)
    assert overflow_totals["overflow_frac_scaled"] == 1.0


@pytest.mark.parametrize("max_grad", [1e-5, 0.3, 1.0, 65504.0 / 1024, 7.0e3])
def test_suggested_scale_is_a_power_of_two_below_the_overflow_limit(max_grad: float) -> None:
    scale = largest_safe_scale(max_grad)
    assert scale == 2.0 ** round(torch.log2(torch.tensor(scale)).item())
    assert scale * max_grad < FP16_MAX
    assert 2 * scale * max_grad >= FP16_MAX or scale == 2.0**24


def test_no_suggestion_without_a_gradient_magnitude() -> None:
    assert largest_safe_scale(0.0) is None
    assert largest_safe_scale(float("inf")) is None


def test_tiny_loss_scale_shows_as_underflow_and_a_sane_one_does_not(run_cfg, tmp_path) -> None:
    def underflow_run(init_scale: str) -> dict:
        overrides = ("precision=fp16", "diagnostics.underflow_every=2", *TINY)
        return train(
            run_cfg(*overrides, f"precision.init_scale={init_scale}"), tmp_path / init_scale
        )

    tiny, sane = underflow_run("1e-12"), underflow_run("1024")
    assert tiny["underflow"]["step"] == 4
    assert tiny["underflow"]["scale"] == pytest.approx(1e-12)
    assert tiny["underflow"]["underflow_frac_scaled"] > 0.9
    assert sane["underflow"]["underflow_frac_scaled"] < 0.1
    assert len(sane["underflow"]["worst"]) == 5
    assert sane["suggested_init_scale"] >= 2.0**10


def poison_head_gradient(model: torch.nn.Module, at_step: int) -> None:
    """The head's weight gradient becomes inf in the backward of step ``at_step`` only."""
    calls = 0

    def poison(grad: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return grad * float("inf") if calls == at_step else grad

    model.head.weight.register_hook(poison)


def test_overflow_in_one_layer_is_reported_as_the_first_overflow(run_cfg) -> None:
    from amp_exp.run import build

    built = build(run_cfg("precision=fp16", *TINY))
    poison_head_gradient(built.model, at_step=2)
    result = built.engine.fit(lambda row: None)
    assert result.progress.first_overflow == {
        "step": 2,
        "loss_finite": True,
        "parameters": ["head.weight"],
        "nonfinite_parameter_count": 1,
        # fp16's default 65536, halved once by the skipped step.
        "backed_off_to": 32768.0,
    }


def test_the_suggested_init_scale_is_never_above_a_scale_the_run_overflowed_at(run_cfg) -> None:
    """Issue 37: a run overflowed at 65536 and backed off, yet its report suggested 2^20: the
    diagnostics steps' largest gradient knows nothing of the step that overflowed."""
    from amp_exp.build import attach_diagnostics

    cfg = run_cfg("precision=fp16", "diagnostics.underflow_every=2", *TINY)
    built = build(cfg)
    diagnostics = attach_diagnostics(cfg, built, lambda row: None)
    poison_head_gradient(built.model, at_step=1)
    result = built.engine.fit(lambda row: None)
    backed_off_to = result.progress.first_overflow["backed_off_to"]
    # The tiny model's gradients alone would allow far more: the cap is what brings it down.
    assert diagnostics.suggested_init_scale > backed_off_to
    assert diagnostics.summary()["suggested_init_scale"] == backed_off_to


@pytest.mark.parametrize(
    ("fp16", "expected"),
    [
        (True, "fp16 gradient range @ step 4: 1.000% would flush to zero unscaled, 0.500% at the "),
        (False, "gradient range @ step 4, if this run were fp16: 1.000% would flush to zero "),
    ],
)
def test_fp16_figures_in_another_precisions_log_say_what_fp16_would_do(
    caplog, fp16: bool, expected: str
) -> None:
    from amp_exp.results.loggers import ConsoleLogger
    from amp_exp.tasks.lm import LanguageModelTask

    row = {
        "kind": "diagnostics",
        "step": 4,
        "grad_underflow_frac": 0.01,
        "grad_underflow_frac_scaled": 0.005,
        "grad_overflow_frac_scaled": 0.0,
        "stale_weight_frac": 0.0,
        "stale_window_steps": 4,
    }
    with caplog.at_level("INFO", logger="amp_exp"):
        ConsoleLogger(10, LanguageModelTask.metrics, fp16=fp16).log(row)
    assert expected in caplog.text
    assert ("at the current scale" in caplog.text) is fp16


def test_checks_pass_on_a_healthy_fp16_run(run_cfg, tmp_path) -> None:
    checks = train(run_cfg("precision=fp16", *TINY), tmp_path)["checks"]
    assert checks["master_weights_fp32"] == {"passed": True, "offenders": []}
    assert checks["unscaled_grads_fp32_finite"] == {"passed": True, "offenders": []}
    assert set(checks) == {"master_weights_fp32", "unscaled_grads_fp32_finite"}


def test_a_planted_fp16_master_weight_is_caught_and_named(run_cfg, tmp_path, monkeypatch) -> None:
    import amp_exp.run

    real_build = amp_exp.run.build

    def build_with_fp16_bias(*args, **kwargs):
        built = real_build(*args, **kwargs)
        built.model.head.bias.data = built.model.head.bias.data.half()
        return built

    monkeypatch.setattr(amp_exp.run, "build", build_with_fp16_bias)
    # Under fp16 GradScaler itself refuses fp16 gradients; bf16 has no scaler to catch this.
    checks = train(run_cfg("precision=bf16", *TINY), tmp_path)["checks"]
    assert checks["master_weights_fp32"] == {"passed": False, "offenders": ["head.bias"]}
    assert checks["unscaled_grads_fp32_finite"]["offenders"] == ["head.bias"]


def test_custom_function_gets_fp32_inputs_only_with_the_amp_decorators() -> None:
    features = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half_input = torch.nn.functional.linear(features, torch.randn(8, 8))
        assert half_input.dtype == torch.bfloat16
        safe = l2_normalize_function("cpu", amp_safe=True).apply(half_input)
        unsafe = l2_normalize_function("cpu", amp_safe=False).apply(half_input)
    # Each function computes in the dtype it receives.
    assert safe.dtype == torch.float32
    assert unsafe.dtype == torch.bfloat16


def test_custom_function_gradient_is_correct() -> None:
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(l2_normalize_function("cpu").apply, (x,))


def test_model_with_the_custom_function_trains_in_fp16(run_cfg, tmp_path) -> None:
    """Every step applied under the fp16 scaler, and every weight moved: the gradient reaches the
    layers below the custom function through its backward."""
    cfg = run_cfg("precision=fp16", "model.normalize_features=true", *TINY)
    initial = {name: p.detach().clone() for name, p in build(cfg).model.named_parameters()}
    summary = train(cfg, tmp_path)
    assert (summary["precision"], summary["steps"], summary["skipped_steps"]) == ("fp16", 4, 0)
    assert summary["loss_scale"] is not None
    assert summary["checks"]["unscaled_grads_fp32_finite"]["passed"]
    rows = [row for row in read_jsonl(tmp_path / "metrics.jsonl") if row["kind"] == "train"]
    assert all(math.isfinite(row["loss"]) and row["grad_norm"] > 0 for row in rows)
    trained = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert [name for name, p in initial.items() if torch.equal(p, trained[name])] == []


def trial_at(ratio: float, low: float, high: float, trend: bool = False) -> dict:
    """A speed trial's speedup as capability/ratio.py's ``Speedup.as_dict`` records it."""
    return {
        "ratio": ratio,
        "rounds": 10,
        "ci": [low, high],
        "confidence": 0.975,
        "total_time_ratio": ratio,
        "trend": {
            "spearman_rho": 0.9 if trend else 0.0,
            "p_value": 0.001 if trend else 0.9,
            "flag": trend,
        },
        "carry_over": 1.0,
    }


@pytest.fixture
def trials(monkeypatch) -> dict:
    """The doctor's speed trials, as if measured: bf16 established slower, fp16 undecided."""
    found = {"bf16": trial_at(0.5, 0.45, 0.55), "fp16": trial_at(0.9, 0.6, 1.3)}
    monkeypatch.setattr(amp_exp.doctor, "speed_trials", lambda device, precisions: found)
    return found


def test_doctor_prints_the_probes_table_then_the_trials_intervals_and_recommendation(
    trials, capsys
) -> None:
    """Caught: the doctor's own speed figure (the probe's ratio of fastest rounds, "bf16 1.47x")
    beside the trial's, or a verdict line without the trial's interval."""
    amp_exp.doctor.main(["--device=cpu"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("device: cpu (")
    assert lines[1].startswith("probe: forward+backward")
    assert lines[2].split() == ["matmul", "conv", "attention"]  # no "vs fp32" column
    assert lines[3].split()[0] == "fp32" and not lines[3].endswith("x")
    assert lines[6].startswith("facts: CPU instructions for bf16/fp16: ")
    assert lines[7] == "fp32: the baseline"
    assert lines[8] == (
        "bf16: slower than fp32 by the speed trial on the probe's kernels: 0.50x [0.45x, 0.55x] "
        "(97.5% CI, 10 AB/BA rounds), total time 0.50x"
    )
    assert lines[9].startswith("fp16: not established faster or slower than fp32 by the speed ")
    assert "0.90x [0.60x, 1.30x] (97.5% CI, 10 AB/BA rounds)" in lines[9]
    # The precisions the probe does not time: what the CPU lacks for each, from its own check.
    lacking = {line.split(":")[0]: line for line in lines[-5:-1]}
    assert list(lacking) == ["fp8", "mxfp8", "mxfp4", "nvfp4"]
    assert "compute capability 10.0+ (Blackwell)" in lacking["mxfp8"]
    assert "no MXFP4 or NVFP4 training kernels" in lacking["nvfp4"]
    assert all("add precision.emulate=true" in line for line in lacking.values())
    assert lines[-1] == (
        "recommendation: precision=fp32: no lower precision's interval lies above fp32's speed "
        "(bf16 0.50x [0.45, 0.55], fp16 0.90x [0.60, 1.30])"
    )


def test_doctor_json_holds_the_kernels_the_trials_and_the_recommendation(trials, capsys) -> None:
    amp_exp.doctor.main(["--device=cpu", "--json"])
    found = json.loads(capsys.readouterr().out)
    assert set(found["measured"]) == {"fp32", "bf16", "fp16"}
    assert "relative_speed" not in found["measured"]["fp16"]
    assert found["measured"]["fp32"]["tflops"] == pytest.approx(1.0)
    assert found["trial"] == trials
    assert found["verdicts"]["bf16"].startswith("slower than fp32 by the speed trial")
    assert found["recommended"] == "fp32"
    assert found["reason"].startswith("no lower precision's interval lies above fp32's speed")
    assert set(found["not_probed"]) == {"fp8", "mxfp8", "mxfp4", "nvfp4"}
    assert found["warmup"] == {"max_steps": 10, "level": 0.05}


def test_the_doctors_trial_is_the_speed_trials_rounds_with_their_interval(
    monkeypatch, capsys, caplog
) -> None:
    """Caught: the doctor timing by its own method (fastest round) instead of the speed trial's
    AB/BA rounds and interval (amp_exp/capability/rounds.py), no progress line per round, or no
    record of how long each side warmed up."""
    small = amp_exp.capability.probe.Shapes(16, (1, 2, 4), (1, 4, 8, 1))
    real = amp_exp.capability.probe.kernel_pass
    monkeypatch.setattr(amp_exp.doctor, "kernel_pass", lambda d, p: real(d, p, small))
    played = short_trials(monkeypatch)
    with caplog.at_level("INFO", logger="amp_exp"):
        amp_exp.doctor.main(["--device=cpu", "--json"])
    found = json.loads(capsys.readouterr().out)
    assert played == ["bf16", "fp16"]
    for precision in ("bf16", "fp16"):
        trial = found["trial"][precision]
        assert trial["rounds"] == 4 and trial["confidence"] == 0.975
        assert found["verdicts"][precision] == trial_verdict(trial)
        assert "(97.5% CI, 4 AB/BA rounds), total time" in found["verdicts"][precision]
        # Each side's warm-up, as the speed trial records its pairs' (caught: none recorded).
        assert set(trial["warmup_steps"]) == set(trial["steady"]) == {"fp32", precision}
        assert all(0 <= steps <= 10 for steps in trial["warmup_steps"].values())
    rounds = [r.message for r in caplog.records if r.message.startswith("speed bf16 vs fp32")]
    assert len(rounds) == 4


def test_doctor_refresh_measures_again_and_forgets_autos_choices(
    monkeypatch, tmp_path, capsys, trials
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    inject_probe({"fp32": 1.0, "bf16": 0.5, "fp16": 0.5})
    write_entries(AUTO_CACHE_FILE, {"some model": {"ms": {"fp32": 1.0}}})
    measured = []

    def fake_measure(device, precisions):
        measured.append(list(precisions))
        return {p: timing_at(2.0 if p == "bf16" else 1.0) for p in precisions}

    monkeypatch.setattr(amp_exp.capability.probe, "measure", fake_measure)
    amp_exp.doctor.main(["--device=cpu", "--json"])
    bf16 = json.loads(capsys.readouterr().out)["measured"]["bf16"]
    assert measured == [] and bf16["tflops"] == pytest.approx(0.5)
    amp_exp.doctor.main(["--device=cpu", "--json", "--refresh"])
    assert measured == [["fp32", "bf16", "fp16"]]
    assert json.loads(capsys.readouterr().out)["measured"]["bf16"]["tflops"] == pytest.approx(2.0)
    assert read_entries(AUTO_CACHE_FILE) == {}
    amp_exp.doctor.main(["--device=cpu", "--json"])
    assert len(measured) == 1  # the new measurement is cached
