"""The user's amp_exp cache: small JSON files of measurements that later runs reuse.

It lives in ``$XDG_CACHE_HOME/amp_exp`` (``~/.cache/amp_exp`` without it). Every file maps a key
to an entry. Losing a file costs a measurement, never a result, so a file that does not parse is
treated as empty, and concurrent writers (the ranks of a job, the jobs of a sweep) may each drop
the other's new entry: both entries are measured again later. What a reader does with an entry
that cannot be a measurement is its own (capability/probe.py, capability/auto.py): it measures
again.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from amp_exp.runtime.atomic import atomic_write


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "amp_exp"


def read_entries(name: str) -> dict[str, Any]:
    """The entries of cache file ``name``; empty when it is missing or unreadable."""
    try:
        entries = json.loads((cache_dir() / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def write_entries(name: str, entries: dict[str, Any]) -> None:
    """Add ``entries`` to cache file ``name``; a cache that cannot be written is skipped."""
    path = cache_dir() / name
    merged = {**read_entries(name), **entries}
    text = json.dumps(merged, indent=1, sort_keys=True)
    with contextlib.suppress(OSError):
        atomic_write(path, lambda file: file.write(text.encode("utf-8")), durable=False)


def forget(name: str) -> None:
    """Remove cache file ``name``, so that its entries are measured again."""
    with contextlib.suppress(FileNotFoundError):
        (cache_dir() / name).unlink()
