"""What both sides of a slab agree on (``shared_states`` writes it in a
worker, ``handed_states`` reads it in the main process): the header's size
and words, and removing its file. Its own module so that neither side imports
the other for it; the worker's descriptors still name the main process's
functions, which pickle resolves by name at the other end."""

from __future__ import annotations

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
