"""Hydra registration: the schemas in the ConfigStore and amp_exp's resolvers.

The Hydra plugins (the evidence and placed sweepers, the submitit launchers) are registered by
the entry point (amp_exp/__main__.py): they run jobs and read their results, a layer above
config. Their optional plugin's module name lives here, where the pre-flight names it when a
launcher is asked for without it.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from amp_exp.config.help import help_text
from amp_exp.config.schema import SCHEMAS, PredictConfig, RunConfig, SensitivityConfig
from amp_exp.launch import register_resolvers

SCHEMA_GROUP = "schema"
# Optional: hydra/launcher=slurm and submitit_*.
SUBMITIT_PLUGIN = "hydra_plugins.hydra_submitit_launcher"


def register_configs() -> None:
    """Store the schemas under ``schema/<group>/`` so they never show up as group options, and
    register the resolvers conf/config.yaml uses."""
    register_resolvers()
    OmegaConf.register_new_resolver("amp_exp.help", help_text, replace=True)
    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    for group, schemas in SCHEMAS.items():
        for name, schema in schemas.items():
            store.store(group=f"{SCHEMA_GROUP}/{group}", name=name, node=schema)
    store.store(group=f"{SCHEMA_GROUP}/sensitivity", name="sensitivity", node=SensitivityConfig)
    store.store(group=f"{SCHEMA_GROUP}/predict", name="predict", node=PredictConfig)
