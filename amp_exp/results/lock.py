"""A run directory belongs to one process: an exclusive lock held for the whole run.

The lock is ``flock`` on a file in the run directory, so the operating system releases it when
the process dies, however it dies: a SIGKILLed run never leaves a stale lock behind. The file
names the holder (pid and host), so a second process can say who is in the way.

A process may take the lock of a directory it already holds: ``python -m amp_exp`` takes it in
its pre-flight, before Hydra writes anything there, and the run takes it again when it starts.
Two ``flock`` calls on two descriptors of one file conflict even within one process, so this
process's locks are counted here instead.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from amp_exp.errors import RunRefused, RuntimeFault, first_line
from amp_exp.results.files import open_data

LOCK_FILE = ".amp_exp.lock"

# Directory -> [descriptor, how many holders in this process].
_held: dict[Path, list[int]] = {}


class RunDirectoryBusy(RunRefused):
    """Another live process is running in this directory; nothing here was touched."""


def busy_message(directory: Path, holder: str) -> str:
    return (
        f"{directory} is in use by {holder}; wait for it to finish, or give this run its own "
        "directory (hydra.run.dir=...)"
    )


def holder_of(directory: Path) -> str | None:
    """Who holds ``directory``'s lock now (another process), or None; creates nothing."""
    key = directory.resolve()
    if key in _held:
        return None
    try:
        fd = os.open(key / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None  # no lock file (no run ever held it), or one no run took: _acquire refuses it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return os.read(fd, 200).decode(errors="replace").strip() or "another process"
    finally:
        os.close(fd)  # also drops the shared lock, if it was granted
    return None


class RunDirectoryLock:
    def __init__(self, directory: Path) -> None:
        self.directory = directory.resolve()
        self.path = self.directory / LOCK_FILE
        self._entered = False

    def __enter__(self) -> RunDirectoryLock:
        if self.directory in _held:
            _held[self.directory][1] += 1
        else:
            _held[self.directory] = [self._acquire(), 1]
        self._entered = True
        return self

    def _acquire(self) -> int:
        # The holder's line is written into the lock: open_data refuses a link planted in its
        # place (the line would land in whatever it points at) and a FIFO, in one line.
        try:
            fd = open_data(self.path, os.O_RDWR | os.O_CREAT)
        except OSError as error:
            raise self._unwritable(error) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunDirectoryBusy(busy_message(self.directory, holder)) from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        except OSError as error:  # a full disk: no run can keep its results here
            os.close(fd)
            raise self._unwritable(error) from None
        return fd

    def _unwritable(self, error: OSError) -> RuntimeFault:
        reason = error.strerror or first_line(str(error))
        return RuntimeFault(
            f"cannot write {self.path} ({reason}); free some space there or choose another "
            "directory"
        )

    def __exit__(self, *exc: object) -> None:
        if not self._entered:
            return
        self._entered = False
        held = _held[self.directory]
        held[1] -= 1
        if held[1] == 0:
            # Closing releases the flock; the file stays, so a reader never races its removal.
            os.close(held[0])
            del _held[self.directory]
