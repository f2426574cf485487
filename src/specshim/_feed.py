"""The feeding half of ``extract``: read, check, plan and tokenize, beside generation.

A spawned process (``specshim-feed``) streams this shard's records
(``_dataset.RecordStream``), decides for each one whether ``--out`` already
holds it (``_store``: by content, never by name), tokenizes and checks the
rest, and hands them to the main process in small chunks through a bounded
queue. So the first ``generate()`` waits for one batch, not for the dataset;
the main process never holds the tokenizer or more than a few chunks; and
tokenization (chat templates are Python) never competes with the generator
for the main process's interpreter lock.

Token ids travel as ``array('i')`` (4 bytes a token, not a Python list's 36),
with their digest computed here. A bad record ends the stream with an error
that names its line; nothing after it is sent, so nothing after it is written.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import time
import traceback
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specshim import _store
from specshim._errors import SpecShimError, UsageError

logger = logging.getLogger(__name__)

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
    why: str | None  # why an existing file is rewritten; None: there was none

    def __len__(self) -> int:
        return len(self.input_ids)


class _Known:
    """What the manifests say about this shard's files: index -> entries.

    Compact on purpose (a resumed shard of a million samples holds a million
    of these): the two digests as bytes and the file's identity.
    """

    def __init__(self, out: Path, shard: tuple[int, int]) -> None:
        index, count = shard
        self.entries: dict[int, list[tuple[bytes, bytes, int, int, int]]] = {}
        for entry in _store.manifest_lines(out):
            if entry.index % count == index:
                self.entries.setdefault(entry.index, []).append(
                    (
                        bytes.fromhex(entry.tokens),
                        bytes.fromhex(entry.record),
                        entry.size,
                        entry.inode,
                        entry.mtime_ns,
                    )
                )
        self.out = out

    def proven(self, index: int) -> tuple[bool, tuple[bytes, bytes] | None]:
        """(a file exists, the digests of the entry that describes it or None)."""
        try:
            stat = _store.final_path(self.out, index).stat()
        except FileNotFoundError:
            return False, None
        for tokens, record, size, inode, mtime_ns in self.entries.get(index, ()):
            if (size, inode, mtime_ns) == (stat.st_size, stat.st_ino, stat.st_mtime_ns):
                return True, (tokens, record)
        return True, None


def _feed(spec: FeedSpec, out: Any) -> None:
    """The feeding process: puts ("chunk", todos, done, rewrites), then ("end", ...).

    Or ("usage", message) for bad input, ("crash", traceback) for anything else.
    """
    from specshim import _settings
    from specshim._dataset import RecordStream, Tokenizing

    parent = os.getppid()

    def put(item: tuple[Any, ...]) -> None:
        while True:
            try:
                out.put(item, timeout=1.0)
                return
            except queue.Full:
                if os.getppid() != parent:  # the main process is gone
                    raise SystemExit(1) from None

    try:
        if spec.trust_remote_code:
            _settings.configure(trust_remote_code=True)
        known = _Known(spec.out, spec.shard)
        stream = RecordStream(spec.data, spec.shard, spec.split, spec.column)
        tokenizing = Tokenizing(spec.model)
        chunk: list[Todo] = []
        done = tokens = samples = 0
        rewrites: dict[str, int] = {}
        sent = time.monotonic()
        for record in stream:
            samples += 1
            exists, proven = known.proven(record.index)
            if proven is not None and proven[1] == bytes.fromhex(record.digest):
                done += 1  # the same record: no need to tokenize it again
            else:
                sample = tokenizing.sample(record, spec.vocab_size, spec.max_len)
                digest = _store.token_digest(sample.input_ids, sample.loss_mask)
                why = None
                if proven is not None and proven[0] == bytes.fromhex(digest):
                    done += 1  # another record, the same tokens
                else:
                    if proven is not None:
                        why = CHANGED_SAMPLE
                    elif exists:
                        why = CHANGED_FILE
                    if why:
                        rewrites[why] = rewrites.get(why, 0) + 1
                    chunk.append(
                        Todo(
                            record.index,
                            record.where,
                            record.digest,
                            digest,
                            array("i", sample.input_ids),
                            array("b", sample.loss_mask),
                            why,
                        )
                    )
                    tokens += len(sample.input_ids)
            now = time.monotonic()
            if (
                len(chunk) >= CHUNK_SAMPLES
                or tokens >= CHUNK_TOKENS
                or (now - sent >= CHUNK_SECONDS and (chunk or done))
            ):
                put(("chunk", chunk, done, rewrites))
                chunk, done, tokens, rewrites, sent = [], 0, 0, {}, now
        put(("chunk", chunk, done, rewrites))
        put(("end", stream.total, samples, tokenizing.truncated))
    except UsageError as exc:
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
        self.queue = context.Queue(maxsize=QUEUE_CHUNKS)
        self.process = context.Process(
            target=_feed, args=(spec, self.queue), name="specshim-feed", daemon=True
        )
        self.done = 0
        self.rewrites: dict[str, int] = {}
        self.total: int | None = None
        self.samples = 0
        self.truncated = 0

    def start(self) -> Feed:
        self.process.start()
        return self

    def __iter__(self) -> Iterator[Todo]:
        while True:
            kind, *fields = self._get()
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
            else:
                raise SpecShimError(
                    "reading the dataset failed unexpectedly (a specshim bug; "
                    "please report it):\n" + fields[0]
                )

    def _get(self) -> tuple[Any, ...]:
        while True:
            try:
                return self.queue.get(timeout=1.0)
            except queue.Empty:
                if self.process.is_alive():
                    continue
            try:  # it may have put its last item just before exiting
                return self.queue.get(timeout=1.0)
            except queue.Empty:
                raise SpecShimError(
                    "the process reading the dataset (specshim-feed) died "
                    f"(exit code {self.process.exitcode}); out of memory is the "
                    "usual cause. Files written so far are complete; rerun the "
                    "same command to resume."
                ) from None

    def close(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
        self.queue.close()
        self.queue.cancel_join_thread()
