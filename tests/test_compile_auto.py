"""trainer.compile=auto, the default: compiled on CUDA where the precision's row says it needs
compiling to be fast (fp8), eager elsewhere and on CPU; a compiled run keeps its precision audit,
taken on one eager step before compilation; speed.compile times eager and compiled side by side."""

from __future__ import annotations

from importlib.util import find_spec
from types import SimpleNamespace

import pytest
import torch

import amp_exp.training.audit.step as audit_module
from amp_exp.build import compiles
from amp_exp.config.precisions import get, names
from amp_exp.config.schema import SpeedConfig
from amp_exp.errors import ConfigError
from amp_exp.run import train
from amp_exp.speed.__main__ import candidates
from amp_exp.speed.trial import compile_variants
from helpers.runs import TINY

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def policy(precision: str, device: torch.device, timed: bool = True) -> SimpleNamespace:
    return SimpleNamespace(spec=get(precision).spec, device=device, timed=timed)


def test_auto_compiles_fp8_on_cuda_only_and_true_or_false_always_win(run_cfg) -> None:
    auto = run_cfg(*TINY)
    assert auto.trainer.compile == "auto"
    assert [name for name in names() if get(name).spec.compile_on_cuda] == ["fp8"]
    assert compiles(auto, policy("fp8", CUDA))
    # Emulated fp8 is never timed: nothing to gain from compiling it.
    assert not compiles(auto, policy("fp8", CUDA, timed=False))
    assert not any(compiles(auto, policy(p, CPU)) for p in names())
    assert not any(compiles(auto, policy(p, CUDA)) for p in names() if p != "fp8")
    assert compiles(run_cfg(*TINY, "trainer.compile=true"), policy("bf16", CPU))
    assert not compiles(run_cfg(*TINY, "trainer.compile=false"), policy("fp8", CUDA))
    with pytest.raises(ConfigError, match=r"trainer.compile=sometimes must be true, false or"):
        run_cfg("trainer.compile=sometimes")


def test_on_cpu_auto_compiles_nothing_and_audits_as_before(run_cfg, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("compiled on CPU"))
    summary = train(run_cfg(*TINY, "precision=bf16"), tmp_path)
    audit = summary["precision_audit"]
    assert summary["compile"] is False and audit["eager_step_of_compiled_run"] is False
    assert audit["step"] == 2  # the first timed step, after the one warm-up step


def test_a_compiled_run_audits_its_first_step_eagerly_before_compiling(
    run_cfg, tmp_path, monkeypatch
) -> None:
    """The audit used to be skipped under compile: it must be present, marked eager, and taken
    when dynamo had compiled nothing yet (an audit at the first timed step, step 2, would come
    after step 1 compiled the graph), its figures bf16's."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda m, mode: real_compile(m, backend="aot_eager"))
    graphs_at_audit = []
    recorded = audit_module.PrecisionAudit._recorded

    def counted(self, *args):
        graphs_at_audit.append(counters["stats"]["unique_graphs"])
        return recorded(self, *args)

    monkeypatch.setattr(audit_module.PrecisionAudit, "_recorded", counted)
    torch._dynamo.reset()
    counters.clear()
    summary = train(run_cfg(*TINY, "precision=bf16", "trainer.compile=true"), tmp_path)
    torch._dynamo.reset()
    audit = summary["precision_audit"]
    # Nothing was compiled when the audited step ended; the later steps ran compiled.
    assert graphs_at_audit == [0] and counters["stats"]["unique_graphs"] >= 1
    assert summary["compile"] is True
    assert audit["eager_step_of_compiled_run"] is True and audit["step"] == 1
    assert audit["engaged"] is True and audit["flops_by_dtype"]["bfloat16"] > 0.5


def test_speed_compile_times_each_precision_eager_and_compiled_against_eager_fp32(
    run_cfg,
) -> None:
    cfg = run_cfg(*TINY, "speed.precisions=[bf16]", "speed.compile=[false,true]")
    variants = compile_variants(candidates(cfg), cfg.speed)
    assert {label: c.trainer.compile for label, c in variants.items()} == {
        "fp32": False,
        "fp32 compiled": True,
        "bf16": False,
        "bf16 compiled": True,
    }
    assert variants["bf16 compiled"].precision.name == "bf16"
    only = compile_variants(candidates(cfg), SpeedConfig(compile=[True]))
    assert {label: c.trainer.compile for label, c in only.items()} == {
        "fp32": False,
        "fp32 compiled": True,
        "bf16 compiled": True,
    }
    assert compile_variants(candidates(cfg), SpeedConfig()).keys() == {"fp32", "bf16"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: fp8 compiles only there")
@pytest.mark.skipif(find_spec("torchao") is None, reason="fp8 needs torchao")
def test_on_cuda_an_fp8_run_compiles_by_default_and_keeps_an_eager_audit(run_cfg, tmp_path) -> None:
    gpt = [
        "model=gpt_tiny",
        "dataset=synthetic_tokens",
        "trainer.device=cuda",
        "trainer.max_steps=6",
        "trainer.log_every=3",
        "wandb.mode=disabled",
    ]
    summary = train(run_cfg(*gpt, "precision=fp8"), tmp_path / "fp8")
    audit = summary["precision_audit"]
    assert summary["compile"] is True and audit["eager_step_of_compiled_run"] is True
    assert audit["engaged"] is True and audit["step"] == 1
    assert any(d.startswith("float8") for d in audit["flops_by_dtype"])
    bf16 = train(run_cfg(*gpt, "precision=bf16"), tmp_path / "bf16")
    assert bf16["compile"] is False and bf16["precision_audit"]["step"] > 1
