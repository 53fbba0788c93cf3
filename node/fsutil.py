"""Atomic file writes (a reader sees the old file or the new one, never a torn one) and the node's
state directory (checked, locked, cleaned of a crashed run's temporary files)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from pathlib import Path

from locoswarm.node.errors import UserError

LOCK_NAME = ".lock"


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        # mkstemp creates 0600; give the file the mode a plain open() would (0666 minus umask).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


class StateDirLock:
    """An exclusive lock on a state directory for this process's lifetime: two nodes on one state dir
    would share one identity (one peer id) and overwrite each other's checkpoints. A POSIX record lock:
    the kernel drops it when the process dies, and forked children (the DHT) do not inherit it, so a
    node killed with SIGKILL never leaves its state dir locked."""

    def __init__(self, path: Path) -> None:
        self.path = path / LOCK_NAME
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _read_pid(self._fd)
            os.close(self._fd)
            self._fd = None
            raise UserError(f"--state-dir {path} is in use by another running node"
                            + (f" (pid {holder})" if holder else "")
                            + "; give each node its own --state-dir") from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # closing drops the lock
            self._fd = None


def _read_pid(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip() or 0) or None
    return None


def prepare_state_dir(path: Path) -> StateDirLock:
    """Make ``path`` usable as a node's state dir, or raise ``UserError`` saying why not and what to do: it
    must be (or become) a writable directory no other node uses. Temporary files of a crashed save
    (``.*.tmp``) are removed: under the lock nobody else can be writing them."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"--state-dir {path} is a file, not a directory; give a directory (created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--state-dir {path} cannot be created ({exc.strerror or exc}); give a directory on a "
                        "writable filesystem") from None
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".probe.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UserError(f"--state-dir {path} is not writable ({exc.strerror or exc}); the node keeps its identity "
                        "and checkpoints there: give a writable directory") from None
    lock = StateDirLock(path)
    for stale in path.glob(".*.tmp"):
        with contextlib.suppress(OSError):
            stale.unlink()
    return lock
