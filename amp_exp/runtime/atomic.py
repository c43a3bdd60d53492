"""Writing a file so that a crash at any moment leaves the old file or the new one, never half.

The content goes to a temporary file beside the target, is flushed to disk and renamed into
place. Files get the mode any file the user creates gets (0666 less the umask: 0644 usually):
results hold weights and metrics, not secrets, and a shared project reads them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

from amp_exp.errors import RuntimeFault

# Temporary files are named ".<target>.<random>.tmp"; a save killed mid-write leaves one behind.
TMP_SUFFIX = ".tmp"


def atomic_write(path: Path, write: Callable[[IO[bytes]], None], durable: bool = True) -> None:
    """Call ``write`` on a temporary file beside ``path``, then rename it into place.

    ``durable`` also fsyncs the file and the rename, for results; a cache needs only the rename.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    # A planted link in the directory's place would carry the write elsewhere (mkdir accepts a
    # link to a directory); the rename below guards only the last component.
    if path.parent.is_symlink():
        raise RuntimeFault(f"{path.parent} is a link; amp_exp never writes through one")
    # mkstemp creates a new file (O_EXCL, O_NOFOLLOW): never one planted under its random name;
    # the rename then replaces a link at ``path`` itself, never what it points at.
    handle, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    try:
        # mkstemp creates 0600; give the file the mode open() would have.
        os.fchmod(handle, default_file_mode())
        with os.fdopen(handle, "wb") as tmp:
            write(tmp)
            tmp.flush()
            if durable:
                os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    if not durable:
        return
    fsync_directory(path.parent)  # make the rename itself durable


def fsync_directory(path: Path) -> None:
    directory = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def install_directory(complete: Path, path: Path) -> None:
    """Rename the directory ``complete`` (written in full under a temporary name) to ``path``.

    A directory cannot replace another in one rename: one already at ``path`` is first renamed
    to a temporary name, so a crash between the renames leaves it there to be cleaned away, and
    ``path`` at any moment is absent, the old directory or the new one, never a mix.
    """
    fsync_directory(complete)  # the names of the files written into it
    aside = path.with_name(f".{path.name}.old{TMP_SUFFIX}")
    if path.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(path, aside)
    os.replace(complete, path)
    fsync_directory(path.parent)
    shutil.rmtree(aside, ignore_errors=True)


def default_file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
