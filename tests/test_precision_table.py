"""A precision's facts live in its plugin's row (config.precisions.PrecisionSpec), found through
the registry: every reader follows the row."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from amp_exp.capability.probe import KERNELS
from amp_exp.config import precisions
from amp_exp.config.precisions import REFERENCE, DType, get, names
from amp_exp.config.schema import PrecisionConfig, Strategy
from amp_exp.errors import ConfigError
from amp_exp.runtime.fsdp import ShardingDtypes
from amp_exp.training.flops import peak_math
from amp_exp.training.precisions.base import create
from helpers.probes import capability_with

CPU = torch.device("cpu")
MODES = list(names())


def test_every_mode_has_one_row_and_auto_has_none() -> None:
    assert set(MODES) == {"fp32", "bf16", "fp16", "bf16_true", "fp8", "mxfp8", "mxfp4", "nvfp4"}
    assert all(get(mode).spec.name == mode for mode in MODES)
    with pytest.raises(ValueError, match="resolve precision=auto first"):
        get("auto")


def test_the_table_imports_no_torch_and_names_dtypes_as_torch_does() -> None:
    assert "torch" not in vars(precisions)
    torch_named = [dtype for dtype in DType if not dtype.block_scaled]
    assert {dtype.value for dtype in torch_named} == {
        str(dtype).removeprefix("torch.") for dtype in (d.torch for d in torch_named)
    }
    # The block-scaled formats the audit counts have no torch dtype: asking is an error.
    block_scaled = {dtype.value: dtype.itemsize for dtype in DType if dtype.block_scaled}
    assert block_scaled == {"mxfp8_e4m3": 1, "mxfp8_e5m2": 1, "mxfp4": 0.5, "nvfp4": 0.5}
    with pytest.raises(ValueError, match="block-scaled format"):
        DType.nvfp4.torch  # noqa: B018
    assert DType.of(torch.bfloat16) is DType.bfloat16 and DType.bfloat16.short == "bf16"


# What each mode does, written down from its definition (README's precision table), not read from
# the table: a wrong row, or a reader that ignores it, fails below.
#   mode: (the dtype a Linear computes in, the weights' dtype, loss scaling, FSDP2 reduce dtype)
DOCUMENTED = {
    "fp32": (torch.float32, torch.float32, False, "fp32"),
    "bf16": (torch.bfloat16, torch.float32, False, "fp32"),
    "fp16": (torch.float16, torch.float32, True, "fp32"),
    "bf16_true": (torch.bfloat16, torch.bfloat16, False, "fp32"),
}


@pytest.mark.parametrize("mode", list(DOCUMENTED))
def test_each_mode_computes_stores_and_scales_as_documented(mode: str) -> None:
    computes, stores, scales, reduces = DOCUMENTED[mode]
    policy = create(mode, PrecisionConfig(name=mode), CPU)
    model = policy.convert_module(torch.nn.Sequential(torch.nn.Linear(16, 16)))
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    seen = []
    linear.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    with policy.forward_context():
        model(torch.randn(4, 16))
    assert seen == [computes]
    assert linear.weight.dtype == stores
    assert (policy.scale() is not None) == scales
    assert ShardingDtypes.for_precision(mode, None).reduce == reduces


@pytest.mark.parametrize("mode", MODES)
def test_the_probe_and_the_datasheet_peak_read_the_row(mode: str) -> None:
    spec = get(mode).spec
    assert peak_math(mode, tf32=False) == spec.peak_math


def test_pure_bf16_reaches_the_same_datasheet_peak_as_bf16() -> None:
    # They once disagreed: the measured peak counted bf16_true as bf16, the datasheet had no
    # "bf16_true" entry, so a bf16_true run had mfu null and mfu_measured set.
    assert peak_math("bf16_true", tf32=True) == peak_math("bf16", tf32=True)
    assert get("bf16_true").spec.probed_as == get("bf16").spec.probed_as


def test_a_changed_row_changes_every_reader(monkeypatch, run_cfg) -> None:
    """Changing a mode is one row: the policy, FSDP2's dtypes, the probe, the datasheet peak and
    the strategy check each follow every field changed (caught: a reader with its own copy)."""
    changed = dataclasses.replace(
        get("bf16").spec,
        compute_dtype=DType.float16,
        autocast_dtype=DType.float16,
        grad_scaler=True,
        reduce_dtype=DType.bfloat16,
        fsdp_param_dtype=DType.float16,
        probed_as="fp16",
        peak_math="fp16",
        strategies=frozenset({Strategy.ddp}),
    )
    monkeypatch.setattr(get("bf16"), "spec", changed)
    policy = create("bf16", PrecisionConfig(), CPU)
    assert policy.scaler is not None and policy.spec.compute_dtype.torch == torch.float16
    with policy.forward_context():
        assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float16
    cast = ShardingDtypes.for_precision("bf16", None, cast_params=True)
    assert (cast.param, cast.reduce) == ("fp16", "bf16")
    # The probe's reader: a run in bf16 is warned by fp16's kernels (0.1x fp32's speed).
    assert capability_with({"fp32": 1, "fp16": 0.1}).advice("bf16", KERNELS, {})
    assert peak_math("bf16", tf32=False) == "fp16"
    with pytest.raises(
        ConfigError, match=r"precision=bf16 does not run with trainer\.strategy=fsdp2"
    ):
        run_cfg("precision=bf16", "trainer.strategy=fsdp2")


@pytest.mark.parametrize("mode", [m for m in MODES if Strategy.fsdp2 not in get(m).spec.strategies])
def test_a_strategy_the_row_does_not_list_is_refused_with_the_valid_ones(mode, run_cfg) -> None:
    overrides = [f"precision={mode}", "trainer.strategy=fsdp2"]
    if mode == "fp8":
        overrides.append("precision.emulate=true")
    with pytest.raises(ConfigError, match=r"valid choices: ddp$"):
        run_cfg(*overrides)


# The copies the registry replaced, by name; none may come back outside the plugins.
COPY_NAMES = {
    "PRECISION_ORDER",
    "PRECISION_COLORS",
    "AUTOCAST_FAMILY",
    "AUTOCAST_DTYPES",
    "RANKABLE",
    "DEFAULT_PRECISIONS",
    "NEXT_UP",
    "LOW_PRECISIONS",
    "PROBED_LOW",
    "AUTO_CANDIDATES",
    "SPECS",
}
# Literal collections of precision names that are no copy of a fact, each with why.
ALLOWED_LISTS = {
    # A command's default selection, checked against the registry when validated (the schema is
    # a leaf below the registry and cannot ask it).
    ("config/schema.py", "SpeedConfig"),
    ("config/schema.py", "PredictConfig"),
    # The HF Trainer's own flags (TrainingArguments.bf16, .fp16, ...), which it reads to say
    # what the Trainer ran: named like precisions, but the Trainer's names.
    ("integrations/transformers.py", ""),
}
PACKAGE = Path(__file__).resolve().parent.parent / "amp_exp"
# Datasheet peaks by math ("bf16", "tf32", "fp8" TFLOP/s), named like precisions but none, and
# what reads a peak among them (a run's, the roofline's).
NOT_PRECISIONS = {"devices.py", "training/flops.py", "predict/roofline.py"}


def copies_in(source: str, known: set[str]) -> list[tuple[str, int]]:
    """(what, line) of each use of a name of ``COPY_NAMES`` and each literal list, tuple, set or
    dict holding two or more precision names, with the class it sits in ('' at top level)."""
    found = []
    tree = ast.parse(source)
    owners = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for inner in ast.walk(node):
                owners[id(inner)] = node.name
    for node in ast.walk(tree):
        # Defined, imported or read: a reader of a removed copy fails only where it runs.
        if isinstance(node, ast.Name) and node.id in COPY_NAMES:
            found.append((node.id, node.lineno))
        if isinstance(node, ast.ImportFrom):
            found += [(a.name, node.lineno) for a in node.names if a.name in COPY_NAMES]
        if isinstance(node, (ast.List, ast.Tuple, ast.Set, ast.Dict)):
            items = node.keys if isinstance(node, ast.Dict) else node.elts
            named = [i.value for i in items if isinstance(i, ast.Constant) and i.value in known]
            if len(named) >= 2:
                found.append((owners.get(id(node), ""), node.lineno))
    return found


def test_the_registry_is_the_only_place_that_lists_precisions() -> None:
    known = set(MODES)
    copies = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where.startswith("training/precisions/") or where in NOT_PRECISIONS:
            continue
        copies += [
            f"{where}:{line} {what}"
            for what, line in copies_in(path.read_text(), known)
            if (where, what) not in ALLOWED_LISTS
        ]
    assert not copies, copies


def test_the_copy_search_finds_the_copies_it_replaced() -> None:
    known = set(MODES)
    assert copies_in('PRECISION_ORDER = {"zz": 0}\n', known) == [("PRECISION_ORDER", 1)]
    assert copies_in("def f():\n    from x import SPECS\n", known) == [("SPECS", 2)]
    assert copies_in('if p in ("bf16", "bf16_true"):\n    pass\n', known) == [("", 1)]
    assert copies_in('class S:\n    x = ["fp32", "fp8"]\n', known) == [("S", 2)]
    assert copies_in('if p == "fp8":\n    pass\n', known) == []


def names_a_precision(node: ast.AST, known: set[str]) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in known
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(
        names_a_precision(item, known) for item in node.elts
    )


def branches_in(source: str, known: set[str]) -> list[int]:
    """The lines that branch on a precision's name written out: a comparison with it
    (``p == "fp16"``, ``p in ("fp32", None)``) or a lookup by it (``rows["fp32"]``,
    ``d.get("fp32")``). The reference is the registry's ``REFERENCE``; anything else a precision
    is or does is its plugin's fact (``spec.grad_scaler``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Subscript):
            operands = [node.slice]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            operands = node.args[:1] if node.func.attr == "get" else []
        else:
            continue
        if any(names_a_precision(operand, known) for operand in operands):
            found.append(node.lineno)
    return found


def test_no_module_but_the_plugins_branches_on_a_precision_s_name() -> None:
    known = set(MODES)
    roots = (PACKAGE, PACKAGE.parent / "hydra_plugins")
    branches = [
        f"{where}:{line}"
        for root in roots
        for path in sorted(root.rglob("*.py"))
        if not (where := path.relative_to(root.parent).as_posix()).startswith(
            "amp_exp/training/precisions/"
        )
        and where.removeprefix("amp_exp/") not in NOT_PRECISIONS
        for line in branches_in(path.read_text(), known)
    ]
    assert not branches, branches


# Where "fp32" is written out and is not the reference precision: the registry that defines it and
# the dtypes' short names, the schema (ReduceDtype's dtype; a command's defaults, below the
# registry), other libraries' names translated to amp_exp's, and the datasheets' math names.
REFERENCE_LITERALS = {
    "config/precisions.py",
    "config/schema.py",
    "integrations/lightning.py",
    "integrations/transformers.py",
    *NOT_PRECISIONS,
}


def reference_literals(source: str) -> list[int]:
    """The lines holding the reference precision's name as a string constant."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and node.value == REFERENCE
    ]


def test_the_reference_is_the_registrys_constant_outside_the_plugins() -> None:
    """A module that wrote "fp32" where it means the baseline every precision is compared with
    would miss a change of the reference; it reads ``REFERENCE``."""
    found = [
        f"{where}:{line}"
        for root in (PACKAGE, PACKAGE.parent / "hydra_plugins")
        for path in sorted(root.rglob("*.py"))
        if not (where := path.relative_to(root.parent).as_posix()).startswith(
            "amp_exp/training/precisions/"
        )
        and where.removeprefix("amp_exp/") not in REFERENCE_LITERALS
        for line in reference_literals(path.read_text())
    ]
    assert not found, found
    assert reference_literals('BASELINE = "fp32"\nx = REFERENCE\n') == [1]


def test_the_branch_search_finds_a_planted_branch_on_a_name() -> None:
    known = set(MODES)
    planted = (
        'fp16 = row["precision"] == "fp16"\n'
        'if label != "fp32":\n    pass\n'
        'x = p in (None, "fp32")\n'
        'base = fastest.get("fp32")\n'
        'loss = report["loss"]["fp32"]\n'
    )
    assert sorted(branches_in(planted, known)) == [1, 2, 4, 5, 6]
    assert branches_in("if p == REFERENCE or spec.grad_scaler:\n    pass\n", known) == []
