"""What ``--help`` says, in one shape for every command: what it does, how to call it, its options
(the config groups a user picks from, or its flags), the other commands, and where the docs are.

The Hydra commands (training, .speed, .sensitivity, .predict) get it as their app help
(``hydra.help.template`` in conf/config.yaml resolves ``${amp_exp.help:<job name>}``), the
argparse ones (.report, .doctor) through results/contract.py's OneLineParser. The groups and
their options are read from conf/, so a new option shows up by itself; the internal ``schema/``
groups never do.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
WIDTH = 100

# Each command: what it does, in one line, and its arguments.
COMMANDS = {
    "amp_exp": (
        "train one model in one precision, or sweep precisions (-m or experiment=...) and get a "
        "report that recommends one",
        "[group=option] [key=value] ...",
    ),
    "amp_exp.report": (
        "compare runs: a recommendation, verdicts against fp32, report.md, report.json, "
        "runs.csv and plots",
        "DIR [DIR ...] [options]",
    ),
    "amp_exp.speed": (
        "time precisions of one run against fp32 in interleaved rounds (speed.json, speed.md)",
        "[group=option] [key=value] ...",
    ),
    "amp_exp.sensitivity": (
        "measure each module and op against a true-fp32 reference, and find what to keep in fp32",
        "[group=option] [key=value] ... [sensitivity.repair=true]",
    ),
    "amp_exp.doctor": (
        "what each precision measures on this machine, and which one to use",
        "[options]",
    ),
    "amp_exp.predict": (
        "predict one training step's time on GPUs that are not here, from one traced step",
        "[group=option] [key=value] ... ['predict.devices=[h100,b200]']",
    ),
    "amp_exp.forecast": (
        "forecast a run's long-run signals to a planned length: the first limit crossed, and when",
        "RUN_DIR [--steps N]",
    ),
}
# The Hydra job name of each Hydra command (conf/config.yaml names training's "train").
JOB_COMMANDS = {"train": "amp_exp", "speed": "amp_exp.speed"}
JOB_COMMANDS |= {"sensitivity": "amp_exp.sensitivity", "predict": "amp_exp.predict"}

# The groups a user picks an option of, each in one line; the others (one default each) are
# sections whose keys are set directly.
GROUPS = {
    "experiment": "presets that sweep and report (start here)",
    "model": "what is trained (language models default to dataset=synthetic_tokens)",
    "dataset": "what it trains on",
    "precision": "the precision to train in (auto measures and picks)",
    "optimizer": "the optimizer",
    "scheduler": "the learning-rate schedule",
}
SECTIONS = ("trainer", "report", "speed", "sensitivity", "predict", "wandb", "diagnostics")
DOCS = (
    "README.md (How to decide), docs/sweeps.md, docs/language_models.md, docs/hf.md, "
    "docs/precision.md, docs/hardware.md, docs/faults.md"
)


def options(group: str) -> list[str]:
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def wrapped(label: str, text: str, indent: int = 24) -> list[str]:
    """``label`` in a column of its own, ``text`` wrapped beside it."""
    lines = textwrap.wrap(text, WIDTH - indent) or [""]
    first = f"  {label}".ljust(indent) + lines[0]
    return [first, *(" " * indent + line for line in lines[1:])]


def header(command: str) -> list[str]:
    what, arguments = COMMANDS[command]
    return [
        *textwrap.wrap(f"python -m {command}: {what}", WIDTH),
        "",
        f"Usage: python -m {command} {arguments}",
    ]


def footer(command: str) -> list[str]:
    others = [name for name in COMMANDS if name != command]
    lines = ["", "Other commands:"]
    for name in others:
        lines += wrapped(f"python -m {name}", COMMANDS[name][0], indent=32)
    return [*lines, "", *textwrap.wrap(f"Docs: {DOCS}", WIDTH)]


def group_lines() -> list[str]:
    lines = ["", "Config groups (group=option):"]
    for group, what in GROUPS.items():
        lines += wrapped(group, f"{what}: {', '.join(options(group))}", indent=14)
    return [
        *lines,
        "",
        "Settings (key=value):",
        *wrapped("", f"{', '.join(f'{name}.*' for name in SECTIONS)}, seed", indent=2),
        "",
        "  -m KEY=A,B            sweep: one job per value (precision=fp32,bf16,fp16 seed=0,1,2)",
        "  --cfg job             print the composed config (every key, its value) and run nothing",
        "  --hydra-help          Hydra's own flags",
    ]


def help_text(job_name: str) -> str:
    """The app help of a Hydra command, by its Hydra job name."""
    command = JOB_COMMANDS.get(job_name, "amp_exp")
    return "\n".join([*header(command), *group_lines(), *footer(command)])


def flags_help(command: str, flags: str) -> str:
    """The help of an argparse command: the same shape, with its flags as the options."""
    flags = textwrap.indent(flags.rstrip(), "  ")
    return "\n".join([*header(command), "", "Options:", flags, *footer(command)])
