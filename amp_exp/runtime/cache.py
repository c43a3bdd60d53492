"""The user's amp_exp cache: small JSON files of measurements that later runs reuse.

It lives in ``$XDG_CACHE_HOME/amp_exp`` (``~/.cache/amp_exp`` without it). Every file maps a key
to an entry. Losing a file costs a measurement, never a result, so a file that does not parse is
treated as empty, and concurrent writers (the ranks of a job, the jobs of a sweep) may each drop
the other's new entry: both entries are measured again later. A cached time that cannot be a
measurement (``implausible_times``) is stale too: its reader measures again, and so is a speed
whose rounds disagreed (``ratio_spread`` above ``WIDE_SPREAD``): a default run once chose bf16 at
a cached 5.14x fp32's speed that a fresh measurement put at 2.07x.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from amp_exp.config.precisions import REFERENCE
from amp_exp.runtime.atomic import atomic_write

# No kernel or training step is timed faster than a microsecond, and no precision runs 1000 times
# faster or slower than fp32 on one (fp16 on CPUs without its kernels: 20-140x slower).
MIN_PLAUSIBLE_MS = 1e-3
PLAUSIBLE_RATIO = 1e3
# A cached speed whose figure lies further than this from its typical round (``ratio_spread``)
# is measured again rather than reused.
WIDE_SPREAD = 0.25


def ratio_spread(baseline: Sequence[float], candidate: Sequence[float]) -> float:
    """How far the speed figure, the baseline's fastest round over the candidate's, lies from
    the median of the rounds' own ratios (each round timed both sides in turn): 0.3 when either
    is 1.3 times the other. One round that a neighbour slowed moves neither; fastest rounds that
    caught the two sides at different moments of a loaded machine move the figure alone."""
    figure = min(baseline) / min(candidate)
    typical = statistics.median(b / c for b, c in zip(baseline, candidate, strict=True))
    return max(figure / typical, typical / figure) - 1


def implausible_times(ms: Mapping[str, Any], baseline: str = REFERENCE) -> str | None:
    """Why cached times (milliseconds, by precision) cannot be measurements, or None if they
    can: each must be a finite number of at least ``MIN_PLAUSIBLE_MS``, within
    ``PLAUSIBLE_RATIO`` of the baseline's."""
    for name, value in ms.items():
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and value >= MIN_PLAUSIBLE_MS):
            return f"{name} took {value!r} ms"
    base = ms.get(baseline)
    for name, value in ms.items():
        if base and not 1 / PLAUSIBLE_RATIO <= value / base <= PLAUSIBLE_RATIO:
            return f"{name} took {value / base:.3g}x {baseline}'s time"
    return None


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
