"""The precision table is the one place a precision's facts live: every reader follows its row."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from amp_exp.config import precisions
from amp_exp.config.precisions import SPECS, DType, spec_of
from amp_exp.config.schema import Precision, PrecisionConfig, Strategy
from amp_exp.errors import ConfigError
from amp_exp.runtime.fsdp import ShardingDtypes
from amp_exp.training.capability import probed_as
from amp_exp.training.flops import peak_math
from amp_exp.training.precision import PrecisionPolicy

CPU = torch.device("cpu")
MODES = [p for p in Precision if p is not Precision.auto]


def test_every_mode_has_one_row_and_auto_has_none() -> None:
    assert set(SPECS) == set(MODES)
    assert all(SPECS[mode].name is mode for mode in MODES)
    with pytest.raises(ValueError, match="resolve precision=auto first"):
        spec_of(Precision.auto)


def test_the_table_imports_no_torch_and_names_dtypes_as_torch_does() -> None:
    assert "torch" not in vars(precisions)
    assert {dtype.value for dtype in DType} == {
        str(dtype).removeprefix("torch.") for dtype in (d.torch for d in DType)
    }
    assert DType.of(torch.bfloat16) is DType.bfloat16 and DType.bfloat16.short == "bf16"


@pytest.mark.parametrize("mode", MODES)
def test_the_policy_fsdp_probe_and_peak_read_the_row(mode: Precision) -> None:
    spec = SPECS[mode]
    policy = PrecisionPolicy(mode, PrecisionConfig(name=mode), CPU)
    assert policy.uses_autocast == (spec.autocast_dtype is not None)
    assert (policy.scaler is not None) == spec.grad_scaler
    assert policy.weight_dtype == spec.weight_dtype.torch
    assert policy.dtype == spec.compute_dtype.torch
    # FSDP2 gathers the stored weights by default, its cast dtype under fsdp_cast_params.
    sharding = ShardingDtypes.for_precision(mode, None)
    assert (sharding.param, sharding.reduce) == (spec.weight_dtype.short, spec.reduce_dtype.short)
    cast = ShardingDtypes.for_precision(mode, None, cast_params=True)
    assert cast.param == (spec.fsdp_param_dtype or spec.weight_dtype).short
    assert probed_as(mode) is spec.probed_as
    assert peak_math(mode, tf32=False) == spec.peak_math


def test_pure_bf16_reaches_the_same_datasheet_peak_as_bf16() -> None:
    # They once disagreed: the measured peak counted bf16_true as bf16, the datasheet had no
    # "bf16_true" entry, so a bf16_true run had mfu null and mfu_measured set.
    assert peak_math(Precision.bf16_true, tf32=True) == peak_math(Precision.bf16, tf32=True)
    assert probed_as(Precision.bf16_true) is probed_as(Precision.bf16)


def test_a_changed_row_changes_every_reader(monkeypatch, run_cfg) -> None:
    """Adding or changing a mode is one row: nothing else holds a copy of its facts."""
    changed = dataclasses.replace(
        SPECS[Precision.bf16], grad_scaler=True, strategies=frozenset({Strategy.ddp})
    )
    monkeypatch.setitem(SPECS, Precision.bf16, changed)
    assert PrecisionPolicy(Precision.bf16, PrecisionConfig(), CPU).scaler is not None
    with pytest.raises(
        ConfigError, match=r"precision=bf16 does not run with trainer\.strategy=fsdp2"
    ):
        run_cfg("precision=bf16", "trainer.strategy=fsdp2")


@pytest.mark.parametrize("mode", [m for m in MODES if Strategy.fsdp2 not in SPECS[m].strategies])
def test_a_strategy_the_row_does_not_list_is_refused_with_the_valid_ones(mode, run_cfg) -> None:
    overrides = [f"precision={mode.value}", "trainer.strategy=fsdp2"]
    if mode is Precision.fp8:
        overrides.append("precision.fp8_emulate=true")
    with pytest.raises(ConfigError, match=r"valid choices: ddp$"):
        run_cfg(*overrides)
