"""Writing samples: each ``data_{i}.pt`` under a temporary name, recorded in
the run's manifest, then renamed into place (``prepare_sample``, then
``commit``); a writer thread, so batch k is written while batch k+1
generates, its files serialized by a small pool (batch k+1's already, while
batch k commits) and committed in sample order by a thread of their own, one
fsync of the manifest for all the batches waiting (``committer``); and the
progress bar or log line."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specshim._base import SpecShimError
from specshim.job.extract.committer import Committer, publish, remove
from specshim.job.extract.feed import Todo
from specshim.job.outdir import store as _store
from specshim.job.outdir.store import final_path

logger = logging.getLogger("specshim.job.extract.command")

WRITERS = 8  # threads serializing a batch's files (at most one per core)
# Batches whose states are alive at once: one generating, one waiting, one
# serializing, one committing (``Writer``'s backpressure).
IN_FLIGHT = 4
_SERIALIZED = object()  # the pending batch's files are all serialized


@dataclass
class Prepared:
    """A sample serialized under its temporary name, not yet recorded."""

    todo: Todo
    tmp: Path
    final: Path
    entry: _store.Entry


def prepare_sample(run: _store.Run, todo: Todo, result: dict[str, Any]) -> Prepared:
    """Check one result and write it under a temporary name (thread-safe):
    ``torch.save``'s bytes, written with the GIL free (``torch_file``)."""
    import torch

    from specshim.job.extract import torch_file

    ids = torch.frombuffer(todo.input_ids, dtype=torch.int32).to(torch.long)
    returned = result["input_ids"]
    if returned.shape != ids.shape or not torch.equal(returned.to(torch.long), ids):
        raise SpecShimError(
            f"sample {todo.index} ({todo.where}): the generator returned other "
            "input ids than it was given"
        )
    data = {
        "input_ids": returned,
        "hidden_states": result["hidden_states"],
        "loss_mask": torch.frombuffer(todo.loss_mask, dtype=torch.int8).to(torch.long),
    }
    final = final_path(run.out, todo.index)
    tmp = run.partial_path(final.name)
    torch_file.save(data, tmp)
    stat = tmp.stat()
    entry = _store.Entry(
        index=todo.index,
        tokens=todo.tokens,
        record=todo.record,
        size=stat.st_size,
        inode=stat.st_ino,
        mtime_ns=stat.st_mtime_ns,
        num_tokens=len(todo),
        truncated=todo.truncated,
    )
    return Prepared(todo, tmp, final, entry)


def commit(run: _store.Run, prepared: list[Prepared]) -> None:
    """Record the samples at once (one fsync of the manifest), then rename
    each into place: a file under its final name is always described by the
    manifest. ``Writer`` does the same in two steps, on two threads."""
    if prepared:
        run.append(*(p.entry for p in prepared))
        publish(run, prepared, [])


class Progress:
    """A bar on a terminal; otherwise a log line at most every 30 seconds."""

    def __init__(self, bar: bool) -> None:
        self.done = self.tokens = 0
        self.started = self.last_log = time.monotonic()
        self.bar = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(unit="sample", dynamic_ncols=True)

    def update(self, samples: int, tokens: int) -> None:
        self.done += samples
        self.tokens += tokens
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = self.tokens / elapsed
        if self.bar is not None:
            self.bar.set_postfix_str(f"{rate:,.0f} tok/s")
            self.bar.update(samples)
        elif time.monotonic() - self.last_log >= 30:
            self.last_log = time.monotonic()
            logger.info(
                "extract: %d samples written, %.0f tok/s (specshim status --out "
                "DIR --data D shows what is left)",
                self.done,
                rate,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def writers() -> int:
    """Threads that serialize a batch's files side by side. torch.save spends
    part of its time outside the GIL (2 threads wrote 1.24x the bytes/s of one
    on a 2-core host), so on a GPU host one core does not set the pace. Where
    vLLM's workers compute on the CPU, one: more would take their cores.
    ``SPECSHIM_WRITER_THREADS`` overrides the choice (a bad value is refused
    when extract starts)."""
    from specshim._base import writer_threads
    from specshim.job.kv_cache import on_cpu

    chosen = writer_threads()
    if chosen is not None:
        return chosen
    return 1 if on_cpu() else min(WRITERS, os.cpu_count() or 1)


class Writer:
    """Writes batch k's files while batch k+1 generates: a thread, its pool
    and its committer.

    ``put`` blocks while a batch waits (backpressure: at most one batch
    generating, one waiting, one serializing and one committing; a batch
    committing holds no states, its files are written). The first failure
    stops the thread; the next ``put``, ``check`` or ``finish`` raises it.
    """

    def __init__(self, run: _store.Run, progress: Progress) -> None:
        self.run, self.progress = run, progress
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=1)
        self.written = self.tokens = 0
        self.handed = 0  # samples put: each one published, or the run fails
        # Seconds the writer thread spent idle (waiting for a batch) and
        # waiting for its pool's files; the committer's own, beside: where
        # the run's time went.
        self.idle = self.serializing = 0.0
        self.error: SpecShimError | None = None
        self.threads = writers()
        self.pool = ThreadPoolExecutor(
            max_workers=self.threads, thread_name_prefix="specshim-save"
        )
        self.committer = Committer(run, self._published)
        self.thread = threading.Thread(
            target=self._loop, name="specshim-writer", daemon=True
        )
        self.thread.start()

    def _loop(self) -> None:
        """Batch k+1's files are serialized on the pool while batch k is
        committed: the pool is never idle between batches for the manifest's
        fsync. Batches are still committed whole and in order."""
        pending: tuple[list[Todo], list[Any]] | None = None
        try:
            while True:
                waited = time.monotonic()
                item = self._next(pending)
                if pending is None:
                    self.idle += time.monotonic() - waited
                following = None
                if item is not None and item is not _SERIALIZED:
                    following = self._submit(*item)
                if pending is not None and not self._settle(*pending):
                    if following is not None:
                        self._discard(following[1])
                    return
                if item is None:
                    return
                pending = following  # None after _SERIALIZED: that one is committed
        finally:
            self.pool.shutdown()
            self.committer.close()  # what was handed to it is published

    @property
    def committing(self) -> float:
        """Seconds the committer spent in fsyncs and renames."""
        return self.committer.busy

    @property
    def syncs(self) -> int:
        """The manifest's fsyncs: fewer than batches where the disk is slow."""
        return self.committer.syncs

    def _published(self, renamed: list[Prepared]) -> None:
        """The committer's report (on its thread): these files are done."""
        tokens = sum(len(p.todo) for p in renamed)
        self.written += len(renamed)
        self.tokens += tokens
        self.progress.update(len(renamed), tokens)

    def _submit(
        self, batch: list[Todo], results: list[dict[str, Any]]
    ) -> tuple[list[Todo], list[Any]]:
        """The batch on the pool, longest sample first, each serialized as
        soon as a thread is free: a long sample started last would leave the
        other threads idle while it ends the batch (the last batch's write is
        what a run waits for after its last call). The futures stay in sample
        order, which is the order they are committed in."""
        pairs = list(zip(batch, results, strict=True))
        futures: list[Any] = [None] * len(pairs)
        for i in sorted(range(len(pairs)), key=lambda i: -len(batch[i])):
            futures[i] = self.pool.submit(prepare_sample, self.run, *pairs[i])
        return batch, futures

    def _next(self, pending: tuple[list[Todo], list[Any]] | None) -> Any:
        """The next batch (None: the end); with a batch on the pool, whichever
        comes first: the next batch, or ``_SERIALIZED`` once every file of
        the pending one is."""
        if pending is None:
            return self.queue.get()
        while not all(future.done() for future in pending[1]):
            try:
                return self.queue.get(timeout=0.005)
            except queue.Empty:
                continue
        return _SERIALIZED

    def _settle(self, batch: list[Todo], futures: list[Any]) -> bool:
        """Hand the committer a batch whose files the pool serializes, its
        manifest lines appended; False (and ``error`` set) where it or an
        earlier batch's commit failed."""
        started = time.monotonic()
        prepared, failed = self._prepare(batch, futures)
        self.serializing += time.monotonic() - started
        if self.committer.error is not None:
            remove(prepared)
            prepared = []
        elif prepared:
            try:
                self.run.append(*(p.entry for p in prepared))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                failed = (prepared[0].todo, exc)
                remove(prepared)
                prepared = []
        if prepared:
            self.committer.put(prepared)
        if failed is None and self.committer.error is None:
            return True
        self.committer.close()  # the batches before the failure are published
        # An earlier batch's commit failed first: its sample is the lower one.
        self.error = self._failure(*(self.committer.error or failed))
        return False

    def _failure(self, todo: Todo, exc: BaseException) -> SpecShimError:
        error = SpecShimError(
            f"writing data_{todo.index}.pt failed "
            f"({type(exc).__name__}: {exc}); the run stopped. The "
            f"{self.written} samples it wrote are complete: fix the "
            "cause (disk space, quota, permissions) and rerun the "
            "same command to resume."
        )
        error.__cause__ = exc
        return error

    @staticmethod
    def _discard(futures: list[Any]) -> None:
        """A later batch's files, serialized while an earlier batch failed:
        removed, never committed."""
        for future in futures:
            try:
                future.result().tmp.unlink(missing_ok=True)
            except BaseException:  # noqa: BLE001 - its file is not kept either
                pass

    def _prepare(
        self, batch: list[Todo], futures: list[Any]
    ) -> tuple[list[Prepared], tuple[Todo, BaseException] | None]:
        """The batch's files once the pool has serialized them: the samples
        before the first failure (in sample order), and that failure. Files
        after it are removed: a batch is committed in order, up to its first
        failure."""
        prepared: list[Prepared] = []
        failed: tuple[Todo, BaseException] | None = None
        for todo, future in zip(batch, futures, strict=True):
            try:
                done = future.result()
            except BaseException as exc:  # noqa: BLE001 - reported in order
                failed = failed or (todo, exc)
                continue
            if failed is None:
                prepared.append(done)
            else:
                done.tmp.unlink(missing_ok=True)
        return prepared, failed

    def check(self) -> None:
        if self.error is None and self.committer.error is not None:
            # Final: the committer publishes nothing after its failure.
            self.error = self._failure(*self.committer.error)
        if self.error is not None:
            raise self.error
        if not self.thread.is_alive() and not self.queue.empty():
            raise SpecShimError(
                "the writer thread stopped with batches still to write (a "
                "specshim bug; please report it); rerun the same command to resume"
            )

    def put(self, batch: list[Todo], results: list[dict[str, Any]]) -> None:
        while True:
            self.check()
            if not self.thread.is_alive():
                raise SpecShimError(
                    "the writer thread is gone (a specshim bug; please report "
                    "it); rerun the same command to resume"
                )
            try:
                self.queue.put((batch, results), timeout=0.5)
                self.handed += len(batch)
                return
            except queue.Full:
                continue

    def finish(self) -> None:
        """Write what is queued, stop the thread; raise its failure if any."""
        while self.thread.is_alive():
            try:
                self.queue.put(None, timeout=0.5)
                break
            except queue.Full:
                continue
        self.thread.join()
        self.check()
        if self.written != self.handed:
            # Fail closed: no error was raised, yet samples went missing.
            raise SpecShimError(
                f"the writer published {self.written} of the {self.handed} "
                "samples handed to it (a specshim bug; please report it); the "
                "files written are complete: rerun the same command to resume"
            )


def drain(writer: Writer) -> None:
    """Let the writer finish what is queued while another error stops the run;
    its own failure, if any, is logged rather than lost."""
    try:
        writer.finish()
    except SpecShimError as exc:
        logger.error("extract: %s", exc)
