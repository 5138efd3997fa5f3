"""Atomic file writes for checkpoints: temp file, fsync, rename, then fsync the directory."""
from __future__ import annotations

import contextlib
import os


def fsync_dir(path: str) -> None:
    """Make a rename inside directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb"):
    """Yield a file that replaces `path` only if the block completes; a failure leaves no trace."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))
