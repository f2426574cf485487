"""A run's manifest as the run writes it: lines laid into room zero-filled
ahead of them, so that making them durable changes no metadata.

Why: on ext4 (ordered mode) a fsync of a file that grew commits the journal,
and the commit waits for the data of every file whose blocks the host
allocated since the last one. While ``extract`` writes gigabytes of states, a
fsync of its manifest took 0.25 to 0.6 s (an H100 host, Kimi-width's 57 KB a
token). Here the room is zero-filled and fsynced once per ``ROOM`` bytes;
lines then overwrite zeros in blocks already allocated, and ``fdatasync``
makes them durable with a data write and a cache flush: nothing to wait for
but them (a third of the time, and a quarter of the worst wait, with 10 GB
written beside on a CPU host). Where the filesystem works otherwise, the same
calls are still correct: fdatasync keeps what reading the lines back needs.

A line holds no NUL byte (``json.dumps`` escapes one), so readers take a NUL
as the room's zeros: the end of what was written, or a line a crash tore
before its fdatasync (``read_manifest`` and ``extract --data-parallel``'s
tally skip it). ``close`` cuts the room off: a finished run's manifest is
plain JSON lines.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

ROOM = 1 << 20  # about 7,000 lines of a sample each


class ManifestRoom:
    """One run's manifest, opened on its first line. Not thread-safe: the
    run's lock serializes it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._end = self._room = 0  # bytes of lines; of lines and zeros
        # A failed fsync of the room: Linux reports a write-back error once
        # per open file, and that fsync may have taken it from lines not yet
        # synced. Every later sync fails with it: nothing is renamed on them.
        self._failed: OSError | None = None

    @property
    def opened(self) -> bool:
        return self._fd is not None

    def write(self, text: str) -> None:
        """Lay ``text`` (whole lines) after the last ones, in the room (made
        first where it is short). Durable only after ``fdatasync`` of a
        ``duplicate``."""
        data = text.encode("utf-8")
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            self._end = self._room = os.fstat(self._fd).st_size
        if self._end + len(data) > self._room:
            grow = max(ROOM, len(data))
            try:
                _write_all(self._fd, bytes(grow), self._room)
                os.fsync(self._fd)  # allocated and sized: lines change neither
            except OSError as exc:
                self._failed = exc
                raise
            self._room += grow
        _write_all(self._fd, data, self._end)
        self._end += len(data)

    def duplicate(self) -> int | None:
        """A descriptor of its own for ``fdatasync`` (None before the first
        line): the caller syncs outside the run's lock and closes it. Raises
        the room's failure, if any (the lines may not reach the disk)."""
        if self._failed is not None:
            raise OSError(
                self._failed.errno,
                f"the manifest could not be made durable ({self._failed.strerror})",
            )
        return None if self._fd is None else os.dup(self._fd)

    def close(self) -> None:
        """Cut the zeros off (no sync: the lines were made durable before
        their files were renamed; where the disk refuses, readers skip the
        zeros) and close."""
        if self._fd is not None:
            try:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, self._end)
            finally:
                os.close(self._fd)
                self._fd = None


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def fdatasync(fd: int) -> None:
    """``os.fdatasync`` where the platform has it (Linux), else ``os.fsync``."""
    getattr(os, "fdatasync", os.fsync)(fd)
