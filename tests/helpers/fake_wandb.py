"""A stand-in for the ``wandb`` module that records every call, for fast W&B logger tests.

amp_exp imports ``wandb`` only inside ``open_wandb_logger``, so installing the fake with
``monkeypatch.setitem(sys.modules, "wandb", FakeWandb())`` routes the whole logger through it.
It stays honest where it can do so cheaply: ``Settings`` builds W&B's real settings object, which
rejects unknown names and bad values, and ``login``/``init`` bind their arguments against the real
functions' signatures, so a misspelt or removed keyword fails the test as it would fail W&B.
"""

from __future__ import annotations

import inspect
import sys
import types
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import wandb as real_wandb

REAL_LOGIN = inspect.signature(real_wandb.login)
REAL_INIT = inspect.signature(real_wandb.init)
REAL_TABLE = inspect.signature(real_wandb.Table)


@dataclass
class Call:
    name: str
    kwargs: dict[str, Any]


class FakeSummary(dict):
    """The run summary: a dict whose ``update`` can be made to fail."""

    def __init__(self, wandb: FakeWandb) -> None:
        super().__init__()
        self._wandb = wandb

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._wandb.record("summary.update", {"args": args, **kwargs})
        super().update(*args, **kwargs)


@dataclass
class FakeTable:
    columns: list[str]
    data: list[list[Any]]


@dataclass
class FakeRun:
    wandb: FakeWandb
    id: str
    init_kwargs: dict[str, Any]
    # define_metric calls, by metric name or glob: their keyword arguments.
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    # One dict per step, with W&B's "_step": as in W&B, logs at the same step share a row.
    history: list[dict[str, Any]] = field(default_factory=list)
    # None until finish() is called.
    exit_code: int | None = None

    def __post_init__(self) -> None:
        self.summary = FakeSummary(self.wandb)
        mode = self.init_kwargs["mode"]
        self.url = f"https://wandb.invalid/{self.init_kwargs.get('project')}/runs/{self.id}"
        sync_dir = Path(self.init_kwargs.get("dir") or ".") / "wandb" / f"{mode}-run-{self.id}"
        self.settings = types.SimpleNamespace(sync_dir=str(sync_dir), mode=mode)

    @property
    def mode(self) -> str:
        return self.init_kwargs["mode"]

    def define_metric(self, name: str, **kwargs: Any) -> None:
        self.wandb.record("define_metric", {"name": name, **kwargs})
        self.metrics[name] = kwargs

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.wandb.record("log", {"metrics": metrics, "step": step})
        if self.history and self.history[-1]["_step"] == step:
            self.history[-1].update(metrics)
        else:
            self.history.append({"_step": step, **metrics})

    def finish(self, exit_code: int | None = None) -> None:
        self.wandb.record("finish", {"exit_code": exit_code})
        self.exit_code = exit_code


class FakeWandb(types.ModuleType):
    """The ``wandb`` module as the logger uses it.

    ``has_key`` is what ``login`` answers: whether an API key is configured. ``raises`` maps a
    call name (``setup``, ``login``, ``init``, ``init:online``, ``init:offline``, ``log``,
    ``define_metric``, ``summary.update``, ``Table``, ``finish``, ``teardown``) to the exception
    it raises, after the call is recorded.
    """

    def __init__(self, has_key: bool = True, raises: dict[str, BaseException] | None = None):
        super().__init__("wandb")
        self.has_key = has_key
        self.raises = dict(raises or {})
        self.calls: list[Call] = []
        self.runs: list[FakeRun] = []
        self.settings: real_wandb.Settings | None = None

    def record(self, name: str, kwargs: dict[str, Any], *fault_names: str) -> None:
        self.calls.append(Call(name, kwargs))
        for fault in (name, *fault_names):
            if fault in self.raises:
                raise self.raises[fault]

    def called(self, name: str) -> list[dict[str, Any]]:
        """The keyword arguments of every call of that name, in order."""
        return [call.kwargs for call in self.calls if call.name == name]

    @property
    def run(self) -> FakeRun:
        """The only run started; fails the test if there were more or none."""
        assert len(self.runs) == 1, f"expected one W&B run, found {len(self.runs)}"
        return self.runs[0]

    def Settings(self, **kwargs: Any) -> real_wandb.Settings:
        return real_wandb.Settings(**kwargs)

    def setup(self, settings: real_wandb.Settings | None = None) -> None:
        self.record("setup", {"settings": settings})
        self.settings = settings

    def login(self, **kwargs: Any) -> bool:
        REAL_LOGIN.bind(**kwargs)
        self.record("login", kwargs)
        return self.has_key

    def init(self, **kwargs: Any) -> FakeRun:
        REAL_INIT.bind(**kwargs)
        self.record("init", kwargs, f"init:{kwargs.get('mode')}")
        run = FakeRun(self, kwargs.get("id") or uuid.uuid4().hex[:8], kwargs)
        self.runs.append(run)
        return run

    def teardown(self) -> None:
        self.record("teardown", {})

    def Table(self, **kwargs: Any) -> FakeTable:
        REAL_TABLE.bind(**kwargs)
        self.record("Table", kwargs)
        return FakeTable(kwargs["columns"], kwargs["data"])


def install_fake_wandb(monkeypatch: Any, **kwargs: Any) -> FakeWandb:
    """Make the next ``import wandb`` return a new fake, for this test only."""
    fake = FakeWandb(**kwargs)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return fake
