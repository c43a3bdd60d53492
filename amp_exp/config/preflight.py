"""Command-line preflight: check every override before Hydra starts a single job.

Hydra reports a bad value with a multi-line message and, in a sweep, only when the job that uses
it starts. Composing each override value here first means ``precision=fp8`` or a typo in job 7 of
a sweep fails at once, with one line that names the valid choices, before any model is built.
"""

from __future__ import annotations

from dataclasses import fields
from importlib.util import find_spec
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict
from omegaconf.errors import ConfigAttributeError, OmegaConfBaseException

from amp_exp.config.store import SUBMITIT_PLUGIN
from amp_exp.config.validate import validate
from amp_exp.errors import ConfigError, first_line

# amp_exp/conf is a symlink to the repository's conf/ (a wheel carries a copy of it).
CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
CONFIG_NAME = "config"
SUBMITIT_LAUNCHERS = "hydra/launcher/submitit_"


def describe_error(error: Exception) -> str:
    """One line that says what is wrong and what would be right."""
    if isinstance(error, ConfigError):
        return str(error)
    missing = getattr(error, "missing_cfg_file", None) or ""
    # hydra/launcher=slurm and submitit_* come with an optional plugin.
    if missing.startswith(SUBMITIT_LAUNCHERS) and not find_spec(SUBMITIT_PLUGIN):
        return f"{missing} needs hydra-submitit-launcher: pip install 'amp_exp[slurm]'"
    if isinstance(error, MissingConfigException) and error.options:
        group, _, option = (error.missing_cfg_file or "").rpartition("/")
        return f"{group}={option} is not an option; valid choices: {', '.join(error.options)}"
    cause = error.__cause__
    if isinstance(cause, ConfigAttributeError) and cause.object_type is not None:
        keys = ", ".join(sorted(f.name for f in fields(cause.object_type)))
        return f"{cause.full_key} is not a known key; valid keys: {keys}"
    if isinstance(error, ConfigCompositionException) and isinstance(cause, OmegaConfBaseException):
        override = str(error).removeprefix("Error merging override ")
        return f"{first_line(override)}: {first_line(str(cause))}"
    return first_line(str(error))


def compose_variants(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The base overrides, plus one variant per value of each sweep override.

    A later override of a key replaces an earlier one, as in Hydra's basic sweeper, so a value on
    the command line wins over a preset's sweep of the same key.
    """
    parsed = OverridesParser.create().parse_overrides(overrides)
    latest = {o.get_key_element(): o for o in parsed if not o.key_or_group.startswith("hydra")}
    fixed = [o.input_line for o in latest.values() if not o.is_sweep_override()]
    variants = [fixed]
    if multirun:
        for key, override in latest.items():
            if override.is_sweep_override():
                variants += [[*fixed, f"{key}={v}"] for v in override.sweep_string_iterator()]
    return variants


def compose_base(config_name: str, overrides: list[str]) -> tuple[DictConfig, bool, list[str]]:
    """The config of the non-sweep overrides, whether it asks for a multirun, and its
    ``hydra.sweeper.params``: presets under conf/experiment/ set both, so
    ``experiment=precision_sweep`` sweeps without -m."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    cfg = compose(config_name, overrides=fixed, return_hydra_config=True)
    hydra_cfg = cfg.hydra
    params = hydra_cfg.sweeper.get("params") or {}
    with open_dict(cfg):
        del cfg["hydra"]
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    return cfg, multirun, [f"{key}={value}" for key, value in params.items()]


def check_overrides(argv: list[str]) -> None:
    """Raise ConfigError, with a one-line message, if any override cannot run."""
    args = get_args_parser().parse_args(argv)
    if args.help or args.hydra_help or args.info or args.shell_completion or args.cfg:
        return
    config_name = args.config_name or CONFIG_NAME
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            base, preset_multirun, preset_params = compose_base(config_name, args.overrides)
            base_variant, *variants = compose_variants(
                [*preset_params, *args.overrides], args.multirun or preset_multirun
            )
            # Composing is the slow part of start-up: without preset values the base variant
            # is exactly the config composed above.
            validate(base if not preset_params else compose(config_name, overrides=base_variant))
            for overrides in variants:
                validate(compose(config_name, overrides=overrides))
    except (ConfigError, OmegaConfBaseException, HydraException) as error:
        raise ConfigError(describe_error(error)) from error
