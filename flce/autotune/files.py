"""Reading a file at a cache path without ever blocking or filling the memory: only a regular file is
read, opened without blocking (a FIFO with no writer blocks an ordinary open, and with it the first
training call that looks a shape up) and read no further than :data:`MAX_FILE_BYTES`."""

from __future__ import annotations

import os
import stat
from pathlib import Path

# A cache holds a few hundred entries (the shipped files: ~15 kB); a file this large is not one, and a
# read stops here instead of filling the memory.
MAX_FILE_BYTES = 16 << 20
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class UnreadablePathError(OSError):
    """What is at a cache path is not read: not a regular file, or a file too large to be a cache."""


def read_bytes(path: Path, limit: int | None = None) -> bytes:
    """The first ``limit`` bytes (default: all of it, up to MAX_FILE_BYTES) of the regular file at
    ``path``. Opened without blocking (a FIFO with no writer would block the open, and a training
    call's lookup with it) and checked to be a regular file before anything is read; raises
    UnreadablePathError otherwise or when the file exceeds MAX_FILE_BYTES, OSError when it cannot be read."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for is_kind, name in _KINDS if is_kind(mode)), "a special file")
            raise UnreadablePathError(f"is {kind}, not a regular file")
        wanted = MAX_FILE_BYTES + 1 if limit is None else limit
        chunks, size = [], 0
        while size < wanted:
            chunk = os.read(fd, min(wanted - size, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if limit is None and size > MAX_FILE_BYTES:
        raise UnreadablePathError(f"is larger than {MAX_FILE_BYTES >> 20} MiB, too large to be an autotune cache")
    return b"".join(chunks)


def special_file(path: Path) -> bool:
    """Whether something other than a regular file (a directory, a FIFO, a device) is at ``path``."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:  # nothing there, or a path that cannot exist
        return False
