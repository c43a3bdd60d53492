"""A real full disk for tests: a small tmpfs, filled to what a test leaves free.

Mounting needs root (or CAP_SYS_ADMIN); where it is refused, the tests that need a disk skip, and
the same faults are covered in-process by /dev/full, which refuses every write with ENOSPC.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

FULL = Path("/dev/full")


@contextlib.contextmanager
def small_disk(mount_point: Path, size_kib: int) -> Iterator[Path]:
    """A tmpfs of ``size_kib`` KiB at ``mount_point`` for the length of the block."""
    mount_point.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def fill(disk: Path, leave_kib: int = 0) -> None:
    """Fill ``disk`` with one file until about ``leave_kib`` KiB are free."""
    with (disk / "filler").open("wb") as filler:
        try:
            while free_kib(disk) > leave_kib:
                filler.write(b"\0" * min(64 * 1024, (free_kib(disk) - leave_kib) * 1024))
                filler.flush()
                os.fsync(filler.fileno())
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise


def free_kib(disk: Path) -> int:
    stats = os.statvfs(disk)
    return stats.f_bavail * stats.f_frsize // 1024
