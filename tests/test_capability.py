"""What is fast here (capability/device.py): the probe only rules out and warns; a precision is
recommended as faster only where a speed trial's interval establishes it, and the words quote the
trial's figure and interval, or say that no trial measured it."""

from __future__ import annotations

import pytest

from amp_exp.capability.device import recommend
from amp_exp.capability.probe import KERNELS
from amp_exp.config.precisions import ResolvedPrecision
from helpers.probes import capability_with
from test_diagnostics import trial_at, warning

fp32, bf16, fp16 = "fp32", "bf16", "fp16"
NOT_MEASURED = (
    "no lower precision's speed was measured by a speed trial here (python -m amp_exp.doctor "
    "measures it)"
)


def test_a_median_6_percent_faster_whose_interval_reaches_below_1_is_not_recommended() -> None:
    """The old rule (a low precision 5% faster by the probe) recommended bf16 here; the trial's
    interval [0.97, 1.16] does not establish it faster, so fp32 stays, the figure quoted."""
    capability = capability_with({fp32: 1, bf16: 1.06, fp16: 0.02})
    undecided = {bf16: trial_at(1.06, 0.97, 1.16)}
    assert capability.recommendation(undecided) == (
        fp32,
        "no lower precision's interval lies above fp32's speed (bf16 1.06x [0.97, 1.16]); "
        "fp16 not measured by a speed trial",
    )
    assert capability.verdicts(undecided)[bf16].startswith(
        "not established faster or slower than fp32 by the speed trial on the probe's kernels: "
        "1.06x [0.97x, 1.16x] (97.5% CI"
    )
    established = {bf16: trial_at(1.06, 1.02, 1.10)}
    assert capability.recommendation(established)[0] == bf16
    assert capability.recommendation(established)[1].startswith(
        "bf16 runs 1.06x [1.02, 1.10] fp32's speed, its interval above 1"
    )


def test_without_a_trial_nothing_is_recommended_faster_and_the_words_say_so() -> None:
    """Caught: the probe's ratio (bf16 1.20x here) speaking as a speed answer."""
    # The Xeon of 2026-11-30: bf16 1.2x fp32's speed, fp16 140x slower despite avx512_fp16.
    xeon = capability_with({fp32: 1, bf16: 1.2, fp16: 1 / 140}, cpu_flags=["avx512_fp16"])
    assert xeon.recommendation({}) == (fp32, NOT_MEASURED)
    assert xeon.verdicts({}) == {
        fp32: "the baseline",
        bf16: "speed not measured: no speed trial here (python -m amp_exp.doctor measures it)",
        fp16: "speed not measured: no speed trial here; the probe ran it about 140x slower than "
        "fp32, left out of precision=auto",
    }
    assert xeon.advice(fp16, KERNELS, {}) == warning(fp16, "140x", fp32)
    # What to use instead is the trial's recommendation, where a trial was run.
    faster = {bf16: trial_at(1.2, 1.1, 1.3)}
    assert xeon.advice(fp16, KERNELS, faster) == warning(fp16, "140x", bf16)
    assert xeon.advice(bf16, KERNELS, {}) == xeon.advice(fp32, KERNELS, {}) == []
    assert xeon.trial_candidates() == [fp32, bf16]


def test_the_probe_warns_for_a_precision_more_than_5_percent_slower_only() -> None:
    epyc = capability_with({fp32: 1, bf16: 1 / 20, fp16: 1 / 25})
    assert epyc.advice(bf16, KERNELS, {}) == warning(bf16, "20x", fp32)
    assert epyc.advice(fp16, KERNELS, {}) == warning(fp16, "25x", fp32)
    assert epyc.trial_candidates() == [fp32]
    even = capability_with({fp32: 1, bf16: 1.02, fp16: 0.99})
    assert even.advice(bf16, KERNELS, {}) == even.advice(fp16, KERNELS, {}) == []
    # Measured 1.5x slower: a warning, but still timed by precision=auto.
    slower = capability_with({fp32: 1, bf16: 1 / 1.5, fp16: 1})
    assert slower.advice(bf16, KERNELS, {}) == warning(bf16, "1.50x", fp32)
    assert slower.trial_candidates() == [fp32, bf16, fp16]


def test_a_gpus_verdicts_name_what_it_lacks_and_its_summary_the_trial_that_chose() -> None:
    turing = capability_with({fp32: 1, fp16: 4.0}, device="cuda")
    assert turing.verdicts({})[bf16].startswith("not supported: test cuda has no native bf16")
    assert turing.recommendation({}) == (fp32, NOT_MEASURED)
    assert capability_with({fp32: 1, fp16: 0.97}, device="cuda").advice(fp16, KERNELS, {}) == []
    hopper = capability_with({fp32: 1, bf16: 3.0, fp16: 3.1}, device="cuda")
    trials = {bf16: trial_at(2.9, 2.6, 3.2), fp16: trial_at(3.0, 2.7, 3.3)}
    summary = hopper.summary(ResolvedPrecision(bf16, "auto", True, trials))
    assert summary["measured_peak_tflops"] == 3.0
    assert summary["recommended"] == bf16  # overlapping: bf16 needs no loss scaling
    assert summary["verdicts"][fp16].startswith(
        "faster than fp32 by the speed trial on this model's forward+backward: 3.00x [2.70x, 3.30x]"
    )
    requested = hopper.summary(ResolvedPrecision(fp16, "requested"))
    assert (requested["recommended"], requested["reason"]) == (fp32, NOT_MEASURED)


@pytest.mark.parametrize(
    ("trials", "recommended"),
    [
        # A median above 1 is no claim: only an interval wholly above 1 is.
        ({bf16: trial_at(1.3, 0.9, 1.8)}, fp32),
        ({bf16: trial_at(1.3, 1.1, 1.5), fp16: trial_at(2.0, 1.7, 2.3)}, fp16),
        # Overlapping intervals: bf16 needs no loss scaling.
        ({bf16: trial_at(1.5, 1.2, 1.8), fp16: trial_at(1.6, 1.3, 1.9)}, bf16),
        # A trend blocks the claim, however far above 1 the interval lies.
        ({bf16: trial_at(2.0, 1.8, 2.2, trend=True)}, fp32),
        ({bf16: {"not_measured": "stopped"}}, fp32),
    ],
)
def test_only_what_a_trials_interval_shows_faster_is_recommended(trials, recommended) -> None:
    assert recommend(trials)[0] == recommended
