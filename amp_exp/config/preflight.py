"""Command-line preflight: check every override before Hydra starts a single job.

Hydra reports a bad value with a multi-line message and, in a sweep, only when the job that uses
it starts. Composing each override value here first means ``precision=fp8`` or a typo in job 7 of
a sweep fails at once, with one line that names the valid choices, before any model is built.
Each composed job is then validated (config/values.py) and given the checks that need no
training (config/cross_checks.py), and the run or sweep directory is checked for being one Hydra
can create. What it found (``Launch``) tells the
entry point which directory the command will write to, so that it can claim it before Hydra
writes anything there (results/ownership.py). A single run's composed config comes with it
(``ComposedRun``), for the job to start from: composed once, not three times.
"""

from __future__ import annotations

import copy
import os
import re
import sys
from argparse import Namespace
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, is_dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir, version
from hydra._internal.callbacks import Callbacks
from hydra._internal.hydra import Hydra
from hydra._internal.utils import (
    compute_search_path_dir,
    create_config_search_path,
    get_args_parser,
)
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import configure_log, run_job
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException
from hydra.initialize import get_gh_backup, restore_gh_from_backup
from hydra.types import HydraContext, RunMode, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, OmegaConfBaseException

from amp_exp.config.cross_checks import check_job, check_output_dir
from amp_exp.config.schema import RunConfig
from amp_exp.config.store import SUBMITIT_PLUGIN, register_configs
from amp_exp.config.values import validate
from amp_exp.errors import ConfigError, first_line

PACKAGE_DIR = Path(__file__).resolve().parent.parent
# amp_exp/conf is a symlink to the repository's conf/ (a wheel carries a copy of it).
CONF_DIR = PACKAGE_DIR / "conf"
CONFIG_NAME = "config"
SUBMITIT_LAUNCHERS = "hydra/launcher/submitit_"


@dataclass(frozen=True)
class OutputDir:
    key: str  # hydra.run.dir or hydra.sweep.dir
    value: str
    # Whether ``value`` is the directory itself: else what it names is known only once the job
    # runs (``${hydra.job.override_dirname}``), and ``value`` is the part before that.
    resolved: bool


@dataclass(frozen=True)
class Launch:
    """What the command will run: its jobs' configs, as checked, and where they write."""

    multirun: bool
    # The single run's config, or the sweep jobs the pre-flight checked (every value of every
    # swept key is in one of them).
    jobs: list[RunConfig]
    output_dir: OutputDir
    # A single run's composition, for the job to start from; None for a sweep, whose jobs Hydra
    # composes as its sweeper runs them.
    composed: ComposedRun | None = None


def describe_error(error: Exception) -> str:
    """One line that says what is wrong and what would be right."""
    if isinstance(error, ConfigError):
        return str(error)
    if isinstance(error, yaml.YAMLError):
        return describe_yaml_error(error)
    missing = getattr(error, "missing_cfg_file", None) or ""
    # hydra/launcher=slurm and submitit_* come with an optional plugin.
    if missing.startswith(SUBMITIT_LAUNCHERS) and not find_spec(SUBMITIT_PLUGIN):
        return f"{missing} needs hydra-submitit-launcher: pip install 'amp_exp[slurm]'"
    if isinstance(error, MissingConfigException) and error.options:
        group, _, option = (error.missing_cfg_file or "").rpartition("/")
        return f"{group}={option} is not an option; valid choices: {', '.join(error.options)}"
    cause = error.__cause__
    if isinstance(cause, ConfigAttributeError) and is_dataclass(cause.object_type):
        keys = ", ".join(sorted(f.name for f in fields(cause.object_type)))
        return f"{cause.full_key} is not a known key; valid keys: {keys}"
    if isinstance(cause, ConfigAttributeError) and cause.object_type is dict:
        # A free-form dict (model.kwargs, model.config): Hydra adds a new key only with +.
        added = str(error).rpartition(" use ")[2]
        return f"{cause.full_key} is a new key in a dict; add it with {added}"
    if isinstance(error, ConfigCompositionException) and isinstance(cause, OmegaConfBaseException):
        override = str(error).removeprefix("Error merging override ")
        return f"{first_line(override)}: {first_line(str(cause))}"
    return first_line(str(error))


def describe_yaml_error(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    if mark is None:
        return f"a config file is not valid YAML: {first_line(str(error))}"
    problem = getattr(error, "problem", None) or first_line(str(error))
    where = f"line {mark.line + 1}, column {mark.column + 1}"
    return f"{mark.name}: not valid YAML at {where}: {problem}"


@contextmanager
def search_path(args: Namespace) -> Iterator[None]:
    """Hydra's config search path as ``hydra_main`` sees it: --config-path (-cp) replaces conf/,
    and --config-dir (-cd) adds a directory, as Hydra's own command line does."""
    primary = str(CONF_DIR)
    if args.config_path is not None:
        primary = compute_search_path_dir(str(PACKAGE_DIR / "__main__.py"), None, args.config_path)
    path = create_config_search_path(primary)
    if args.config_dir is not None:
        extra = Path(args.config_dir).absolute()
        if not extra.is_dir():
            raise ConfigError(f"--config-dir {args.config_dir}: no such directory")
        path.prepend(
            provider="command-line",
            path=f"file://{extra}",
            anchor=SearchPathQuery(provider="schema"),
        )
    backup = get_gh_backup()
    version.setbase("1.3")
    GlobalHydra.instance().clear()
    Hydra.create_main_hydra2(task_name="amp_exp", config_search_path=path)
    try:
        yield
    finally:
        restore_gh_from_backup(backup)


def compose_checked(
    config_name: str, overrides: list[str], return_hydra_config: bool = False
) -> DictConfig:
    """``compose``, with a null group choice (``model=null``) named with the valid choices:
    Hydra's own error names neither the group nor the choices."""
    loader = GlobalHydra.instance().config_loader()
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.is_sweep_override() or override.is_delete() or override.value() is not None:
            continue
        options = loader.get_group_options(override.key_or_group)
        if options:
            raise ConfigError(
                f"{override.key_or_group}=null is not an option; "
                f"valid choices: {', '.join(options)}"
            )
    return compose(config_name, overrides=overrides, return_hydra_config=return_hydra_config)


def run_config(overrides: list[str]) -> RunConfig:
    """The validated config of a run with ``overrides``, composed from conf/ as the command line
    composes it: for the scripts that build a run in their own process (scripts/bench_*.py)."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return validate(compose_checked(CONFIG_NAME, overrides))


def sweep_jobs(overrides: list[str], multirun: bool) -> list[list[str]]:
    """Jobs of the sweep, as override lists, that together use every value of every swept key.

    The first job takes each swept key's first value; each further one changes one key to one of
    its other values. Every job is one the sweep runs, so a default no job uses is never checked
    (``-m dataset=image_folder dataset.root=a,b`` never runs with the default root). A later
    override of a key replaces an earlier one, as in Hydra's basic sweeper, so a value on the
    command line wins over a preset's sweep of the same key.
    """
    parsed = OverridesParser.create().parse_overrides(overrides)
    # Of Hydra's own settings only the search path changes what a job's config is.
    latest = {
        o.get_key_element(): o
        for o in parsed
        if not o.key_or_group.startswith("hydra") or o.key_or_group == "hydra.searchpath"
    }
    fixed = [o.input_line for o in latest.values() if not o.is_sweep_override()]
    swept = {key: o for key, o in latest.items() if o.is_sweep_override()}
    if swept and not multirun:
        key, override = next(iter(swept.items()))
        raise ConfigError(
            f"{override.input_line} sweeps {key}: add -m (--multirun) to run one job per value, "
            f"or write {key}=[...] for a list"
        )
    values = [[f"{key}={v}" for v in o.sweep_string_iterator()] for key, o in swept.items()]
    firsts = [key_values[0] for key_values in values]
    jobs = [[*fixed, *firsts]]
    for i, key_values in enumerate(values):
        jobs += [[*fixed, *firsts[:i], value, *firsts[i + 1 :]] for value in key_values[1:]]
    return jobs


def compose_base(
    config_name: str, overrides: list[str], multirun: bool
) -> tuple[DictConfig, bool, list[str], OutputDir]:
    """The config of the non-sweep overrides (its ``hydra`` node included), whether it asks for a
    multirun, its ``hydra.sweeper.params`` (presets under conf/experiment/ set both, so
    ``experiment=precision_sweep`` sweeps without -m), and the directory Hydra will create."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    cfg = compose_checked(config_name, fixed, return_hydra_config=True)
    hydra_cfg = cfg.hydra
    multirun = multirun or hydra_cfg.mode == RunMode.MULTIRUN
    # Hydra's sweeper, and so its params, only runs in a multirun.
    params = (hydra_cfg.sweeper.get("params") or {}) if multirun else {}
    output_dir = output_directory(cfg, "sweep" if multirun else "run")
    return cfg, multirun, [f"{key}={value}" for key, value in params.items()], output_dir


def without_hydra(cfg: DictConfig) -> DictConfig:
    """What the job sees of a composed config: everything but Hydra's own ``hydra`` node."""
    job = copy.deepcopy(cfg)
    with open_dict(job):
        del job["hydra"]
    return job


@dataclass(frozen=True)
class ComposedRun:
    """A single run's config as the pre-flight composed it, and the Hydra that composed it.

    ``run`` starts the job from it as ``Hydra.run`` would (output directory, logging, .hydra/,
    callbacks), without the two more compositions Hydra's entry point would make: one to learn
    the mode, one for the job (about a quarter of a second each).
    """

    config: DictConfig
    config_name: str
    hydra: Hydra

    def run(self, task_function: TaskFunction) -> Any:
        cfg = self.config
        if cfg.hydra.mode is None:  # as Hydra's command line records a run it was not told of
            with open_dict(cfg.hydra):
                cfg.hydra.mode = RunMode.RUN
                cfg.hydra.overrides.hydra.append("hydra.mode=RUN")
        configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
        callbacks = Callbacks(cfg)
        callbacks.on_run_start(config=cfg, config_name=self.config_name)
        result = run_job(
            hydra_context=HydraContext(config_loader=self.hydra.config_loader, callbacks=callbacks),
            task_function=task_function,
            config=cfg,
            job_dir_key="hydra.run.dir",
            job_subdir_key=None,
        )
        callbacks.on_run_end(config=cfg, config_name=self.config_name, job_return=result)
        return result.return_value  # raises what the job raised


def output_directory(cfg: DictConfig, mode: str) -> OutputDir:
    """``hydra.<mode>.dir`` and its value: resolved where what it names is known before the run
    (the timestamp of amp_exp's default is this process's launch time, the one Hydra resolves
    later), else the part before its first interpolation, the directory it will be created in."""
    key = f"hydra.{mode}.dir"
    try:
        value = OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
        return OutputDir(key, str(value), True)
    except OmegaConfBaseException:
        raw = str(OmegaConf.to_container(cfg.hydra)[mode]["dir"])
        return OutputDir(key, raw.partition("${")[0] or ".", False)


# What a language model's config picks when no dataset is given (conf/model/gpt_tiny.yaml).
TOKENS_DATASET = "synthetic_tokens"


def default_dataset_note(cfg: DictConfig, overrides: list[str]) -> str | None:
    """One line for a run whose dataset the model's config picked, not the user or a preset:
    ``model=gpt_tiny`` alone trains on synthetic tokens, and says so, once per command."""
    choices = cfg.hydra.runtime.choices
    if choices.get("dataset") != TOKENS_DATASET or choices.get("experiment"):
        return None
    if any(o.lstrip("+~").split("=")[0].split("@")[0] == "dataset" for o in overrides):
        return None
    return (
        f"dataset={TOKENS_DATASET}: the default for model={choices.get('model')}, a language "
        "model (dataset= picks another)"
    )


def check_overrides(argv: list[str]) -> Launch | None:
    """Raise ConfigError, with a one-line message, if any override cannot run; else what will
    run (None for Hydra's own --help, --info, --cfg, which run nothing)."""
    args = get_args_parser().parse_args(argv)
    if args.help or args.hydra_help or args.info or args.shell_completion or args.cfg:
        return None
    config_name = args.config_name or CONFIG_NAME
    try:
        with search_path(args):
            base, multirun, preset_params, output_dir = compose_base(
                config_name, args.overrides, args.multirun
            )
            composer = GlobalHydra.instance().hydra
            note = default_dataset_note(base, args.overrides)
            if note is not None:
                print(f"amp_exp: {note}", file=sys.stderr)
            jobs = sweep_jobs([*preset_params, *args.overrides], multirun)
            # Composing is the slow part of start-up: a single run is the config composed above.
            configs = (
                [without_hydra(base)]
                if not multirun
                else (compose_checked(config_name, overrides) for overrides in jobs)
            )
            checked = []
            for cfg in configs:
                checked.append(validate(cfg))
                check_job(checked[-1], os.environ)
        check_output_dir(output_dir.key, output_dir.value)
    # Hydra raises ValueError for some bad overrides, and PyYAML its own errors for a config
    # file that does not parse.
    except (ValueError, yaml.YAMLError, OmegaConfBaseException, HydraException) as error:
        raise ConfigError(describe_error(error)) from error
    except AttributeError as error:
        # OmegaConf fails on some values it cannot merge (a dict override of the sweeper's params
        # node), re-raising the AttributeError of its own code with the key in its message.
        found = re.search(r"full_key: (\S+)", str(error))
        if found is None:
            raise
        key = found.group(1)
        raise ConfigError(
            f"{key}: the override's value cannot be merged into the config; write it as Hydra's "
            "docs do (sweeper params: 'hydra.sweeper.params.seed=0,1', or -m seed=0,1)"
        ) from error
    composed = None
    if not multirun and not args.experimental_rerun and composer is not None:
        composed = ComposedRun(base, config_name, composer)
    return Launch(multirun, checked, output_dir, composed)
