"""Committing the writer's files off its thread: group commit.

The writer thread appends a batch's manifest lines (no fsync) and hands the
batch here. This thread takes every batch handed over since its last pass,
makes their lines durable with one fsync of the manifest, then renames each
file into place, in sample order. So a file is under its final name only
once a fsync that covers the line describing it has returned (the rule
``docs/output.md`` states), and the writer's pool never waits for a fsync.

On ext4 a fsync of the manifest may wait for data the host has been writing
since the last one (ordered mode): one per batch took 0.25 s each on an H100
host writing 2.9 GB/s of states. While one runs, the next batches queue,
and the following fsync covers them all: the slower the disk, the fewer.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from specshim.job.outdir import store as _store


def publish(run: _store.Run, prepared: list[Any], renamed: list[Any]) -> None:
    """Make the manifest lines appended so far durable (one fsync), then
    rename each file of ``prepared`` into place, in order; each one renamed
    is added to ``renamed`` (what a failure half-way leaves done)."""
    run.sync()
    for p in prepared:
        os.replace(p.tmp, p.final)
        renamed.append(p)


class Committer:
    """A thread that publishes the batches ``put`` hands it, as many at once
    as are waiting. The first failure stops it: ``error`` is the first sample
    not published and its exception; batches after it are removed, never
    renamed. ``close`` publishes what is queued and joins the thread."""

    def __init__(self, run: _store.Run, published: Callable[[list[Any]], None]) -> None:
        self.run, self._published = run, published
        self._queued: list[list[Any]] = []
        self._ready = threading.Condition()
        self._closing = False
        self.error: tuple[Any, BaseException] | None = None
        self.busy = 0.0  # seconds in fsync and renames
        self.syncs = 0
        self.thread = threading.Thread(
            target=self._loop, name="specshim-commit", daemon=True
        )
        self.thread.start()

    def put(self, prepared: list[Any]) -> None:
        """A batch whose manifest lines ``run.append`` has written."""
        with self._ready:
            self._queued.append(prepared)
            self._ready.notify()

    def close(self) -> None:
        with self._ready:
            self._closing = True
            self._ready.notify()
        self.thread.join()

    def _loop(self) -> None:
        while True:
            with self._ready:
                while not self._queued and not self._closing:
                    self._ready.wait()
                queued, self._queued = self._queued, []
            if not queued:
                return
            prepared = [p for batch in queued for p in batch]
            try:
                if self.error is None:
                    self._publish(prepared)
                else:
                    remove(prepared)
            except BaseException as exc:  # noqa: BLE001 - a bug: still reported
                # Never a dead thread with no error: the writer would go on
                # and the run end with samples missing.
                self.error = self.error or (prepared[0].todo, exc)

    def _publish(self, prepared: list[Any]) -> None:
        started = time.monotonic()
        renamed: list[Any] = []
        failed = None
        try:
            publish(self.run, prepared, renamed)
        except BaseException as exc:  # noqa: BLE001 - the writer reports it
            remove(prepared[len(renamed) :])
            failed = (prepared[len(renamed)].todo, exc)
        self.syncs += 1
        self.busy += time.monotonic() - started
        self._published(renamed)
        # Set last: whoever reads the error finds the files published before
        # it already counted.
        self.error = failed


def remove(prepared: list[Any]) -> None:
    """Files never to be published: their temporary names removed, as far as
    the disk lets (one left over is removed by the run's close, or by the
    next run once this one is gone; it is never under a final name)."""
    for p in prepared:
        with contextlib.suppress(OSError):
            p.tmp.unlink(missing_ok=True)
