"""A run directory belongs to one process: an exclusive lock held for the whole run.

The lock is ``flock`` on a file in the run directory, so the operating system releases it when
the process dies, however it dies: a SIGKILLed run never leaves a stale lock behind. The file
names the holder (pid and host), so a second process can say who is in the way.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from amp_exp.errors import RunRefused

LOCK_FILE = ".amp_exp.lock"


class RunDirectoryBusy(RunRefused):
    """Another live process is running in this directory; nothing here was touched."""


class RunDirectoryLock:
    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> RunDirectoryLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunDirectoryBusy(
                f"{self.path.parent} is in use by {holder}; wait for it to finish, or give this "
                "run its own directory (hydra.run.dir=...)"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            # Closing releases the flock; the file stays, so a reader never races its removal.
            os.close(self._fd)
            self._fd = None
