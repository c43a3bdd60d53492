"""Hydra registration: the schemas in the ConfigStore, amp_exp's resolvers and launchers."""

from __future__ import annotations

from importlib.util import find_spec

from hydra.core.config_store import ConfigStore

from amp_exp.config.launch import register_resolvers
from amp_exp.config.schema import SCHEMAS, PredictConfig, RunConfig, SensitivityConfig

SCHEMA_GROUP = "schema"
# Optional: hydra/launcher=slurm and submitit_* (amp_exp.config.launchers).
SUBMITIT_PLUGIN = "hydra_plugins.hydra_submitit_launcher"


def register_configs() -> None:
    """Store the schemas under ``schema/<group>/`` so they never show up as group options, and
    register the resolvers conf/config.yaml uses."""
    register_resolvers()
    store = ConfigStore.instance()
    store.store(name="run_schema", node=RunConfig)
    for group, schemas in SCHEMAS.items():
        for name, schema in schemas.items():
            store.store(group=f"{SCHEMA_GROUP}/{group}", name=name, node=schema)
    store.store(group=f"{SCHEMA_GROUP}/sensitivity", name="sensitivity", node=SensitivityConfig)
    store.store(group=f"{SCHEMA_GROUP}/predict", name="predict", node=PredictConfig)
    # hydra/launcher=submitit_*: jobs that resume when requeued, if the optional plugin is there.
    if find_spec(SUBMITIT_PLUGIN) is not None:
        from amp_exp.config.launchers import register_launchers

        register_launchers()
