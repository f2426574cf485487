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


def create_locked(path: str) -> int:
    """A descriptor of a new file at ``path`` (refused if one is there), with
    its owner's shared lock already held when the name appears: the file is
    made without a name (``O_TMPFILE``), locked, then linked under ``path``,
    so ``remove_unlocked`` in another process never finds it unlocked. Where
    that cannot be done (no ``O_TMPFILE`` on the filesystem, no ``/proc``),
    it is created by name and locked at once: a window of microseconds, in
    which only a sweep of files whose pid looks dead (``--ipc=host``) could
    fall."""
    fd = _nameless_locked(path)
    if fd is not None:
        return fd
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except BaseException:
        os.close(fd)
        unlink_quietly(path)
        raise
    return fd


def _nameless_locked(path: str) -> int | None:
    directory, name = os.path.split(path)
    try:
        fd = os.open(directory or ".", os.O_TMPFILE | os.O_RDWR, 0o600)
    except (AttributeError, OSError):
        return None
    try:
        folder = os.open(directory or ".", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        os.close(fd)
        return None
    linked = False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        # linkat(AT_SYMLINK_FOLLOW): os.link uses it only given a dir_fd
        # (plain link() would link /proc's symlink itself).
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=folder, follow_symlinks=True)
        linked = True
    except FileExistsError:
        raise  # as O_EXCL would: the name is taken
    except OSError:
        return None  # created by name instead
    finally:
        os.close(folder)
        if not linked:
            os.close(fd)
    return fd
