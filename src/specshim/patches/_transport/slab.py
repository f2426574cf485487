"""What both sides of a slab agree on (``shared_states`` writes it in a
worker, ``handed_states`` reads it in the main process): the header's size
and words, and removing its file. Its own module so that neither side imports
the other for it; the worker's descriptors still name the main process's
functions, which pickle resolves by name at the other end."""

from __future__ import annotations

import fcntl
import glob
import os
from typing import Any

HEADER = 4096  # bytes 0-8: the fetch's generation; 8-16: the one released
DIRECTORY = "/dev/shm"
PREFIX = "specshim-states"  # a worker's files: PREFIX-PID-TOKEN-TOKEN


def files_of(pid: int, directory: str = DIRECTORY) -> str:
    """The glob pattern of the worker ``pid``'s slab files in ``directory``."""
    return os.path.join(glob.escape(directory), f"{PREFIX}-{pid}-*")


def read_word(mapping: Any, at: int) -> int:
    """The header's 8-byte little-endian word at byte ``at``."""
    return int.from_bytes(mapping[at : at + 8], "little")


def unlink_quietly(path: str) -> None:
    """Remove a slab's file; one already gone is what was wanted."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_unlocked(path: str) -> int | None:
    """Remove a slab's file if no process holds a lock on it (a worker holds
    one on each of its slabs while it lives): its size, or None where it was
    kept (locked, gone meanwhile, or not ours to read). The lock, not the
    pid in the name, tells a live owner: under ``--ipc=host`` the directory
    is shared with processes of other PID namespaces, whose pids repeat."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return None  # its worker lives
    else:
        size = os.fstat(fd).st_size
        unlink_quietly(path)
        return size
    finally:
        os.close(fd)
