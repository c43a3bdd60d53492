"""``python -m helpers.count_compositions ARGS``: ``python -m amp_exp ARGS`` that prints, as it
ends, how many times Hydra composed a config (``ConfigLoaderImpl.load_configuration``)."""

from __future__ import annotations

import runpy
import sys

from hydra._internal.config_loader_impl import ConfigLoaderImpl

calls = []
composing = ConfigLoaderImpl.load_configuration


def counted(self, *args, **kwargs):
    calls.append(kwargs.get("overrides"))
    return composing(self, *args, **kwargs)


ConfigLoaderImpl.load_configuration = counted
sys.argv = ["amp_exp", *sys.argv[1:]]
try:
    runpy.run_module("amp_exp", run_name="__main__", alter_sys=True)
finally:
    print(f"compositions: {len(calls)}", flush=True)
