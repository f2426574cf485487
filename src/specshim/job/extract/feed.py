"""The feeding half of ``extract``: read, check, plan and tokenize, beside generation.

A spawned process (``specshim-feed``) streams this shard's records
(``dataset.RecordStream``), decides for each one whether ``--out`` already
holds it (``_store``: by content, never by name), tokenizes and checks the
rest, and hands them to the main process in small chunks through a pipe and a
bounded queue. So the first ``generate()`` waits for one batch, not for the dataset;
the main process never holds the tokenizer or more than a few chunks; and
tokenization (chat templates are Python) never competes with the generator
for the main process's interpreter lock.

Token ids travel as ``array('i')`` (4 bytes a token, not a Python list's 36),
with their digest computed here. A bad record ends the stream with an error
that names its line; nothing after it is sent, so nothing after it is written.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import time
import traceback
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specshim._base import SpecShimError, UsageError
from specshim.job.outdir import store as _store

if TYPE_CHECKING:
    from specshim.job.inputs.dataset import Record
    from specshim.job.inputs.tokenizing import Tokenizing

# A chunk is sent when it holds this many samples or tokens, or has waited
# this long; at most QUEUE_CHUNKS chunks wait in the queue.
CHUNK_SAMPLES = 16
CHUNK_TOKENS = 1 << 16
CHUNK_SECONDS = 0.5
QUEUE_CHUNKS = 8

CHANGED_FILE = (
    "the file is not the one specshim recorded (truncated, edited or foreign)"
)
CHANGED_SAMPLE = "the dataset's sample changed since the file was written"


@dataclass(frozen=True)
class FeedSpec:
    """Everything the feeding process needs (it shares nothing else)."""

    data: Path
    model: Path
    out: Path
    shard: tuple[int, int]
    split: str | None
    column: str | None
    vocab_size: int
    max_len: int  # samples are truncated to this many tokens
    trust_remote_code: bool


@dataclass
class Todo:
    """A sample to generate and write."""

    index: int
    where: str
    record: str  # record_digest of the dataset record
    tokens: str  # token_digest of (input_ids, loss_mask)
    input_ids: array  # array('i')
    loss_mask: array  # array('b')
    truncated: bool = False  # cut to max_len tokens

    def __len__(self) -> int:
        return len(self.input_ids)


def _compact_identity(
    entry: tuple[bytes, bytes, int, int, int, bool],
) -> tuple[int, int, int]:
    return entry[2], entry[3], entry[4]


class _Known:
    """What the manifests say about this shard's files: index -> entries.

    Compact on purpose (a resumed shard of a million samples holds a million
    of these): the two digests as bytes and the file's identity.
    """

    def __init__(self, out: Path, shard: tuple[int, int], max_len: int) -> None:
        index, count = shard
        self.entries: dict[int, list[tuple[bytes, bytes, int, int, int, bool]]] = {}
        for entry in _store.manifest_lines(out):
            if entry.index % count == index:
                self.entries.setdefault(entry.index, []).append(
                    (
                        bytes.fromhex(entry.tokens),
                        bytes.fromhex(entry.record),
                        entry.size,
                        entry.inode,
                        entry.mtime_ns,
                        entry.was_truncated(max_len),
                    )
                )
        self.out = out

    def proven(self, index: int) -> tuple[bool, tuple[bytes, bytes, bool] | None]:
        """(a file exists, the entry that describes it or None: its two digests
        and whether its sample was truncated)."""
        try:
            stat = _store.final_path(self.out, index).stat()
        except FileNotFoundError:
            return False, None
        entry = _store.proving(self.entries.get(index, ()), stat, _compact_identity)
        return True, None if entry is None else (entry[0], entry[1], entry[5])


def _decide(
    record: Record, known: _Known, tokenizing: Tokenizing, spec: FeedSpec
) -> tuple[Todo | None, bool, str | None]:
    """One record: (what to write, or None where a file already holds it;
    whether the sample is cut to max_len; why an existing file is rewritten)."""
    exists, proven = known.proven(record.index)
    if proven is not None and proven[1] == bytes.fromhex(record.digest):
        return None, proven[2], None  # the same record: not tokenized again
    sample = tokenizing.sample(record, spec.vocab_size, spec.max_len)
    digest = _store.token_digest(sample.input_ids, sample.loss_mask)
    if proven is not None and proven[0] == bytes.fromhex(digest):
        return None, sample.truncated, None  # another record, the same tokens
    why = CHANGED_SAMPLE if proven is not None else CHANGED_FILE
    todo = Todo(
        record.index,
        record.where,
        record.digest,
        digest,
        array("i", sample.input_ids),
        array("b", sample.loss_mask),
        sample.truncated,
    )
    return todo, sample.truncated, why if exists else None


def _feed(spec: FeedSpec, pipe: Any) -> None:
    """The feeding process: sends ("chunk", todos, done, rewrites), then ("end", ...).

    Or ("usage", message) for bad input, ("crash", traceback) for anything else.
    ``pipe`` is the write end of a pipe only the main process reads: a send
    blocks while the main process is behind (backpressure), and fails once it
    is gone, which ends this process at once.
    """
    import signal

    from specshim.job.inputs.dataset import RecordStream
    from specshim.job.inputs.tokenizing import Tokenizing

    # Ctrl-C is the main process's to handle; it stops this one.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def put(item: tuple[Any, ...]) -> None:
        try:
            pipe.send(item)
        except OSError:  # BrokenPipeError: nobody reads any more
            os._exit(1)

    chunk: list[Todo] = []
    done = 0
    rewrites: dict[str, int] = {}
    try:
        known = _Known(spec.out, spec.shard, spec.max_len)
        stream = RecordStream(spec.data, spec.shard, spec.split, spec.column)
        tokenizing = Tokenizing(spec.model, spec.trust_remote_code)
        # Samples cut to max_len, whichever run wrote them: tokenized now, or
        # already done (the manifest says whether they were cut).
        tokens = samples = truncated = 0
        sent = time.monotonic()
        for record in stream:
            samples += 1
            todo, cut, why = _decide(record, known, tokenizing, spec)
            truncated += cut
            if todo is None:
                done += 1
            else:
                chunk.append(todo)
                tokens += len(todo)
            if why is not None:
                rewrites[why] = rewrites.get(why, 0) + 1
            now = time.monotonic()
            if (
                len(chunk) >= CHUNK_SAMPLES
                or tokens >= CHUNK_TOKENS
                or (now - sent >= CHUNK_SECONDS and (chunk or done))
            ):
                put(("chunk", chunk, done, rewrites))
                chunk, done, tokens, rewrites, sent = [], 0, 0, {}, now
        put(("chunk", chunk, done, rewrites))
        put(("end", stream.total, samples, truncated))
    except UsageError as exc:
        put(("chunk", chunk, done, rewrites))  # whole batches before it get written
        put(("usage", str(exc)))
    except BaseException:  # noqa: BLE001 - reported to the main process
        put(("crash", traceback.format_exc()))


class Feed:
    """The main process's end: iterate it for the samples to write, in order.

    ``done``, ``rewrites`` grow as it goes; ``total`` (the dataset's size),
    ``samples`` (this shard's) and ``truncated`` are set at its end. A bad
    record raises ``UsageError``; a feeding process that dies, ``SpecShimError``.
    """

    def __init__(self, spec: FeedSpec) -> None:
        self.spec = spec
        context = multiprocessing.get_context("spawn")
        self._receive, self._send = context.Pipe(duplex=False)
        self.process = context.Process(
            target=_feed, args=(spec, self._send), name="specshim-feed", daemon=True
        )
        # Read by a thread as the feed sends, at most QUEUE_CHUNKS ahead; it
        # ends with the feed's last message, or ("dead",) at end of file.
        self.items: queue.Queue[tuple[Any, ...]] = queue.Queue(maxsize=QUEUE_CHUNKS)
        self._reader = threading.Thread(
            target=self._read, name="specshim-feed-reader", daemon=True
        )
        self.done = 0
        self.rewrites: dict[str, int] = {}
        self.total: int | None = None
        self.samples = 0
        self.truncated = 0

    def _crash_report(self, trace: str) -> str:
        """One line naming the error; the whole traceback goes to a file."""
        last = (trace.strip().splitlines() or ["?"])[-1]
        path = Path(self.spec.out) / ".specshim" / "feed-crash.txt"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(trace)
            where = f"; its traceback is in {path}"
        except OSError:
            where = ""
        return (
            f"reading the dataset failed unexpectedly ({last}): a specshim bug, "
            f"please report it{where}"
        )

    def start(self) -> Feed:
        self.process.start()
        # Only the feed holds the write end now: if it dies, even halfway
        # through a message, the reader sees end of file instead of waiting.
        self._send.close()
        self._reader.start()
        return self

    def _read(self) -> None:
        while True:
            try:
                item = self._receive.recv()
            except (EOFError, OSError):
                item = ("dead",)
            self.items.put(item)
            if item[0] != "chunk":
                return

    def __iter__(self) -> Iterator[Todo]:
        while True:
            kind, *fields = self.items.get()
            if kind == "chunk":
                todos, done, rewrites = fields
                self.done += done
                for why, count in rewrites.items():
                    self.rewrites[why] = self.rewrites.get(why, 0) + count
                yield from todos
            elif kind == "end":
                self.total, self.samples, self.truncated = fields
                return
            elif kind == "usage":
                raise UsageError(fields[0])
            elif kind == "crash":
                raise SpecShimError(self._crash_report(fields[0]))
            else:
                self.process.join(timeout=5)
                raise SpecShimError(
                    "the process reading the dataset (specshim-feed) died "
                    f"(exit code {self.process.exitcode}); out of memory is the "
                    "usual cause. Files written so far are complete; rerun the "
                    "same command to resume."
                )

    def close(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
        self._send.close()
        # The feed is gone, so the reader meets end of file; let it hand over
        # what it holds and stop before its end of the pipe is closed.
        deadline = time.monotonic() + 10
        while self._reader.is_alive() and time.monotonic() < deadline:
            try:
                self.items.get(timeout=0.1)
            except queue.Empty:
                pass
        self._receive.close()
