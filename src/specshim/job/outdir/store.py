"""The output directory of ``extract``: what is in it, proven by content.

Layout of ``OUT``::

    data_config.json              the run settings, fixed by the first sample written
    data_{i}.pt                   sample i of the dataset (speculators' format)
    .data_{i}.{run}.partial       a file being written by run ``run``
    .specshim/manifest/{run}.jsonl  one line per file that run wrote
    .specshim/runs/{run}          heartbeat of a live run (touched every 30 s)

A ``data_{i}.pt`` counts as done only if a manifest line describes *this* file
(same inode, size and modification time: a truncated, edited or foreign file
matches none) and says it holds the tokens and loss mask that sample i of the
dataset has now. Nothing here reads an output file: the check costs one
``stat`` per file and one pass over the manifests.

Runs are named ``{host}-{pid}-{random}``; a run only ever removes its own
temporary files, or those of a run whose heartbeat has stopped (on this host:
whose process is gone), so any number of shards, on any number of hosts
sharing the directory, can write into it at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import secrets
import socket
import stat as _stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from specshim._base import SpecShimError, UsageError, pid_alive
from specshim.job.outdir.data_config import CONFIG_NAME, read_config
from specshim.job.outdir.manifest import Entry, read_manifest
from specshim.job.outdir.manifest_room import ManifestRoom, fdatasync

T = TypeVar("T")

META = ".specshim"
HEARTBEAT_SECONDS = 30.0
STALE_AFTER = 300.0  # a heartbeat older than this belongs to a dead run

# Sample i's file has one name: no zero padding, so data_01.pt is not sample
# 1's (the trainer would read it beside data_1.pt).
_DATA = re.compile(r"^data_(0|[1-9]\d*)\.pt$")
ORPHAN_SUFFIX = ".orphan"  # a moved orphan's name ends so: the trainer skips it
_PARTIAL = re.compile(
    r"^\.(?:data_\d+\.pt|data_config\.json)\.(?P<run>[^.]+)\.partial$"
)


def final_path(out: Path, index: int) -> Path:
    return out / f"data_{index}.pt"


def token_digest(input_ids: list[int], loss_mask: list[int]) -> str:
    """A fingerprint of a sample's content: its tokens and its loss mask."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps([input_ids, loss_mask], separators=(",", ":")).encode())
    return digest.hexdigest()


def record_digest(record: dict[str, Any]) -> str:
    """A fingerprint of a dataset record as parsed (key order and spacing aside).

    With the same tokenizer and settings (fixed in ``data_config.json``), the
    same record always becomes the same tokens; a rerun uses this to skip
    tokenizing what it already holds.
    """
    text = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def file_identity(stat: os.stat_result) -> tuple[int, int, int]:
    """What a manifest entry records of the file it wrote: size, inode, mtime."""
    return (stat.st_size, stat.st_ino, stat.st_mtime_ns)


def proving(
    candidates: Iterable[T],
    stat: os.stat_result,
    identity: Callable[[T], tuple[int, int, int]],
) -> T | None:
    """The rule every reader of the manifests follows: of the entries for one
    file (in the order runs wrote them), the last that describes the file as
    it is now proves what it holds; ``identity`` gives an entry's
    (size, inode, mtime). None: no entry vouches for the file."""
    now = file_identity(stat)
    found = None
    for candidate in candidates:
        if identity(candidate) == now:
            found = candidate
    return found


def prepare_out(out: Path) -> None:
    """Create ``out`` (and its metadata folder) or say in one sentence why not."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a directory")
    try:
        (out / META / "manifest").mkdir(parents=True, exist_ok=True)
        (out / META / "runs").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"--out {out}: cannot create the output directory ({exc.strerror})"
        ) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: the directory is not writable")


def open_run(out: Path, header: dict[str, Any]) -> tuple[Run, int]:
    """``out`` made ready, this run's manifest started with ``header``, and the
    leftovers of runs that died removed: the run, and how many were removed.
    (Whether ``out`` holds output of other settings is the plan's check:
    ``data_config.check_out``.)"""
    prepare_out(out)
    run = Run(out, header)
    run.start()
    try:
        return run, run.remove_dead_partials()
    except BaseException:
        run.close()
        raise


def _regular_file(path: Path) -> bool:
    """Whether ``path`` itself is a regular file: the only kind specshim writes,
    so the only kind it removes (a folder or link under such a name is not
    its own)."""
    try:
        return _stat.S_ISREG(path.lstat().st_mode)
    except FileNotFoundError:
        return False


class Run:
    """One ``extract`` process's hold on an output directory."""

    def __init__(self, out: Path, header: dict[str, Any] | None = None) -> None:
        self.out = out
        # First line of the manifest: what this run was (shard, dataset size),
        # for ``specshim status``.
        self.header = dict(header or {})
        host = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"
        self.host = host
        self.id = f"{host}-{os.getpid()}-{secrets.token_hex(4)}"
        self.heartbeat = out / META / "runs" / self.id
        self.manifest = out / META / "manifest" / f"{self.id}.jsonl"
        self._manifest = ManifestRoom(self.manifest)
        # The writer thread records while the main thread may close the run
        # (Ctrl-C twice): nothing is recorded after close.
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- liveness ---------------------------------------------------------

    def start(self) -> None:
        try:
            self.heartbeat.write_text(
                json.dumps({"pid": os.getpid(), "host": self.host})
            )
        except OSError as exc:
            raise UsageError(
                f"--out {self.out}: cannot write {self.heartbeat.parent} "
                f"({exc.strerror or exc}), where each run says it is alive; make "
                "it writable"
            ) from None
        self._thread = threading.Thread(
            target=self._beat, name="specshim-heartbeat", daemon=True
        )
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            with contextlib.suppress(OSError):
                os.utime(self.heartbeat)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            self._closed = True
            self._manifest.close()
        # As far as the disk lets: a run stopped by a failing disk reports
        # that failure, not this (what is left, the next run removes).
        with contextlib.suppress(OSError):
            self.heartbeat.unlink(missing_ok=True)
            for leftover in self.out.glob(f".*.{self.id}.partial"):
                leftover.unlink(missing_ok=True)

    def is_live(self, run: str) -> bool:
        """Whether run ``run`` may still be writing (never guesses 'dead' early)."""
        if run == self.id:
            return True
        beat = self.out / META / "runs" / run
        try:
            age = time.time() - beat.stat().st_mtime
        except FileNotFoundError:
            age = float("inf")
        host, _, rest = run.rpartition("-")[0].rpartition("-")
        if host == self.host and rest.isdigit():
            return pid_alive(int(rest)) and age < STALE_AFTER * 10
        return age < STALE_AFTER

    def remove_dead_partials(self) -> int:
        """Delete temporary files of runs that are gone; returns how many."""
        removed = 0
        for path in self.out.iterdir():
            match = _PARTIAL.match(path.name)
            if match and not self.is_live(match["run"]) and _regular_file(path):
                path.unlink(missing_ok=True)
                removed += 1
        runs = self.out / META / "runs"
        for beat in runs.iterdir():
            if not self.is_live(beat.name) and _regular_file(beat):
                beat.unlink(missing_ok=True)
        return removed

    # -- writing ----------------------------------------------------------

    def partial_path(self, name: str) -> Path:
        return self.out / f".{name}.{self.id}.partial"

    def publish_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """Create ``data_config.json`` unless it exists; return the one in force.

        Created with a hard link from a temporary file, which fails if another
        run created it first: exactly one run's settings win.
        """
        existing = read_config(self.out)
        if existing is not None:
            return existing
        tmp = self.partial_path(CONFIG_NAME)
        tmp.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        try:
            os.link(tmp, self.out / CONFIG_NAME)
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
        return read_config(self.out) or config

    def annotate(self, fields: dict[str, Any]) -> None:
        """Add ``fields`` to this run's manifest header (read by ``status``)."""
        with self._lock:
            self._write_line(json.dumps(fields))

    def record(self, *entries: Entry) -> None:
        """Append ``entries`` to this run's manifest and make them durable:
        the caller renames their files into place only after this returns."""
        self.append(*entries)
        self.sync()

    def append(self, *entries: Entry) -> None:
        """Write ``entries``' lines to this run's manifest, in the kernel but
        not yet durable: their files are renamed into place only after a
        later ``sync`` returns (``extract``'s committer)."""
        # Entry's fields in their order: index, tokens, record, size, inode,
        # mtime_ns, num_tokens, truncated (``manifest.parse_line``).
        lines = [json.dumps(dataclasses.astuple(entry)) for entry in entries]
        if not lines:
            return
        with self._lock:
            self._write_line("\n".join(lines))

    def sync(self) -> None:
        """Make every line appended so far durable: one fdatasync
        (``manifest_room``), outside the lock on a descriptor of its own
        (appends go on; close cannot pull it)."""
        with self._lock:
            self._refuse_if_closed()
            fd = self._manifest.duplicate()
        if fd is None:
            return
        try:
            fdatasync(fd)
        finally:
            os.close(fd)

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise SpecShimError(f"run {self.id} is closed; nothing more is recorded")

    def _write_line(self, line: str) -> None:
        self._refuse_if_closed()
        if not self._manifest.opened:
            header = {"run": self.id, "started": time.time(), **self.header}
            self._manifest.write(json.dumps(header) + "\n")
        self._manifest.write(line + "\n")


def existing_files(
    out: Path, wanted: set[int] | None = None
) -> dict[int, os.stat_result]:
    """``stat`` of every ``data_{i}.pt`` in ``out`` (only ``wanted`` ones if given)."""
    found = {}
    with os.scandir(out) as entries:
        for item in entries:
            match = _DATA.match(item.name)
            if not match:
                continue
            index = int(match.group(1))
            if wanted is None or index in wanted:
                with contextlib.suppress(FileNotFoundError):
                    stat = item.stat(follow_symlinks=False)
                    # A folder so named is no file (the trainer reads no folder);
                    # anything else is, to be proven or refused as it is.
                    if not _stat.S_ISDIR(stat.st_mode):
                        found[index] = stat
    return found


def orphans(files: dict[int, os.stat_result], total: int) -> list[int]:
    """Indices of ``data_{i}.pt`` files that no sample of a ``total``-sample
    dataset owns (left by a run on a longer dataset). speculators' trainer
    reads every ``.pt`` in the directory, so they would be trained on."""
    return sorted(index for index in files if index >= total)


def move_orphans(out: Path, indices: list[int], run: str) -> Path:
    """Move those files to ``.specshim/orphans/{run}/``, renamed
    ``data_{i}.pt.orphan``: the trainer walks every folder under OUT, hidden
    ones too, and reads every name that ends in ``pt``. Returns the folder. A
    file another shard moved first is skipped."""
    folder = out / META / "orphans" / run
    folder.mkdir(parents=True, exist_ok=True)
    for index in indices:
        name = final_path(out, index).name
        with contextlib.suppress(FileNotFoundError):
            os.rename(final_path(out, index), folder / (name + ORPHAN_SUFFIX))
    return folder


def settle_orphans(
    out: Path, total: int, run: str, move: bool
) -> tuple[list[str], list[int], Path | None]:
    """What of ``out`` is no sample of a dataset of ``total``: files the
    trainer would read that are not specshim's, and the samples past its end
    (moved aside for ``run`` where ``move``, into the folder returned)."""
    foreign = foreign_files(out)
    found = orphans(existing_files(out), total)
    folder = move_orphans(out, found, run) if move and found else None
    return foreign, found, folder


def trainer_files(out: Path) -> list[Path]:
    """What speculators 0.3.0's trainer reads from ``out``
    (``speculators.train.data.list_files``): every file, in every folder under
    it, hidden ones included, whose name ends in ``pt``."""
    found = []
    for root, _folders, names in os.walk(out):
        found += [Path(root) / name for name in names if name.endswith("pt")]
    return found


def foreign_files(out: Path) -> list[str]:
    """The files the trainer would read that are no sample's file (a copy, a
    zero-padded name, anything under a subfolder), relative to ``out``."""
    return sorted(
        str(path.relative_to(out))
        for path in trainer_files(out)
        if not (path.parent == out and _DATA.match(path.name))
    )


def manifests(out: Path) -> Iterator[tuple[dict[str, Any], list[Entry]]]:
    """Each run's manifest: its header and its entries (``read_manifest``:
    torn and damaged lines are skipped, damaged ones with a warning)."""
    folder = out / META / "manifest"
    if not folder.is_dir():
        return
    for path in sorted(folder.glob("*.jsonl")):
        if path.is_file():  # else not specshim's, and a FIFO would block
            yield read_manifest(path)


def manifest_lines(out: Path) -> Iterator[Entry]:
    """Every entry of every run's manifest."""
    for _, entries in manifests(out):
        yield from entries
