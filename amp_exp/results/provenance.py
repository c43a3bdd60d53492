"""Which code produced a result: the git commit, with ``-dirty`` for uncommitted changes.

Free of torch, so a report reads runs without paying for importing it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parents[2]


def git(*args: str) -> subprocess.CompletedProcess[str]:
    """``git`` in the repository amp_exp runs from, its output captured."""
    return subprocess.run(["git", *args], cwd=REPO_DIR, capture_output=True, text=True, timeout=5)


def git_sha() -> str | None:
    """The code version that produced a result, with ``-dirty`` for uncommitted changes."""
    try:
        sha = git("rev-parse", "HEAD")
        if sha.returncode != 0:
            return None
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None
