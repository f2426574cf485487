"""``specshim status``: how far an ``extract`` output directory has got.

Cheap by construction: it loads no model and reads no output file, only
``stat`` results, ``data_config.json`` and the runs' manifests (and, with
``--data``, the dataset's records, without tokenizing them).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specshim._base import UsageError
from specshim.job.outdir import store as _store
from specshim.job.outdir.data_config import read_config


@dataclass
class RunSummary:
    run: str
    shard: tuple[int, int] | None
    samples: int = 0
    tokens: int = 0
    first: float = 0.0  # seconds since the epoch: the run's start (or first file)
    last: float = 0.0  # and its last file
    live: bool = False

    @property
    def tokens_per_second(self) -> float | None:
        span = self.last - self.first
        return self.tokens / span if span > 0 and self.samples > 1 else None


@dataclass
class Status:
    total: int | None  # samples in the dataset (None: not known)
    done: int = 0  # files proven by a manifest line
    tokens: int = 0
    unproven: list[int] = field(default_factory=list)  # files no line describes
    missing: list[int] = field(default_factory=list)  # samples without a file
    orphans: list[int] = field(default_factory=list)  # files of no sample
    # Files written from a record the dataset (--data) no longer holds as it
    # was: not done until a rerun has checked their tokens.
    changed: list[int] = field(default_factory=list)
    # Other files the trainer would read (relative to OUT): no sample's name.
    foreign: list[str] = field(default_factory=list)
    # The manifest entry that proves each file done.
    proven: dict[int, _store.Entry] = field(default_factory=dict)
    bytes: int = 0
    runs: list[RunSummary] = field(default_factory=list)
    per_shard: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return (
            self.total is not None
            and not self.missing
            and not self.unproven
            and not self.orphans
            and not self.foreign
            and not self.changed
            and self.done == self.total
        )


def _credit_runs(
    written: dict[int, list[tuple[RunSummary, _store.Entry]]],
    files: dict[int, os.stat_result],
) -> dict[int, _store.Entry]:
    """The entry that proves each file (the store's rule), credited to the run
    that wrote it."""
    proven = {}
    for index, candidates in written.items():
        found = _store.proving(candidates, files[index], lambda c: c[1].file_identity())
        if found is None:
            continue
        summary, entry = found
        proven[index] = entry
        summary.samples += 1
        summary.tokens += entry.num_tokens
        stamp = entry.mtime_ns / 1e9
        summary.first = min(summary.first or stamp, stamp)
        summary.last = max(summary.last, stamp)
    return proven


def collect(out: Path, data: Path | None = None, **dataset: Any) -> Status:
    """What ``out`` holds, proven by the manifests (and ``data`` if given)."""
    if not out.is_dir():
        raise UsageError(f"--out {out}: no such directory")
    config = read_config(out)
    files = _store.existing_files(out)
    foreign = _store.foreign_files(out)
    probe = _store.Run(out)  # only to ask whether a run is alive
    runs, sizes = [], []
    written: dict[int, list[tuple[RunSummary, _store.Entry]]] = {}
    for header, entries in _store.manifests(out):
        shard = header.get("shard")
        summary = RunSummary(header.get("run", "?"), tuple(shard) if shard else None)
        summary.live = probe.is_live(str(summary.run))
        summary.first = float(header.get("started") or 0.0)
        for entry in entries:
            if entry.index in files:
                written.setdefault(entry.index, []).append((summary, entry))
        if (size := header.get("dataset_samples")) is not None:
            sizes.append((float(header.get("finished") or 0), int(size)))
        runs.append(summary)
    proven = _credit_runs(written, files)
    changed: list[int] = []  # written from a record the dataset no longer has
    total = None
    if data is not None:
        from specshim.job.inputs.dataset import RecordStream

        stream = RecordStream(data, **dataset)
        for record in stream:  # counted, not kept
            entry = proven.get(record.index)
            if entry is not None and entry.record != record.digest:
                changed.append(record.index)
        total = stream.total
    elif sizes:
        # The dataset as the run that finished reading it last saw it (a
        # rerun on a shorter dataset: the files past its end are orphans).
        total = max(sizes)[1]
    status = Status(total=total, runs=runs, foreign=foreign, changed=changed)
    proven = {i: e for i, e in proven.items() if i not in set(changed)}
    settled = data is not None or not any(run.live for run in runs)
    if total is not None and settled:  # a file no sample owns is no sample done
        status.orphans = _store.orphans(files, total)
        proven = {i: e for i, e in proven.items() if i < total}
    status.done, status.proven = len(proven), proven
    status.tokens = sum(e.num_tokens for e in proven.values())
    status.bytes = sum(stat.st_size for stat in files.values())
    status.unproven = sorted(
        set(files) - set(proven) - set(status.orphans) - set(changed)
    )
    if total is not None:
        status.missing = [i for i in range(total) if i not in files]
    shards = {r.shard for r in runs if r.shard}
    for index, count in sorted(shards):
        expected = len(range(index, total, count)) if total is not None else None
        done = sum(1 for i in proven if i % count == index)
        status.per_shard[f"{index}/{count}"] = (done, expected if expected else -1)
    if config is None and files:
        status.unproven = sorted(files)
    return status


def _few_names(names: list[str]) -> str:
    return " (" + ", ".join(names[:5]) + (" ..." if len(names) > 5 else "") + ")"


def render(status: Status, out: Path) -> list[str]:
    gib = 1 << 30
    total = "?" if status.total is None else str(status.total)
    lines = [
        f"status: {out}: {status.done} of {total} samples done, "
        f"{status.tokens:,} tokens, {status.bytes / gib:,.2f} GiB on disk",
    ]
    if status.total is None:
        lines.append("  dataset size unknown: give --data to count what is missing")
    else:
        lines.append(f"  missing: {len(status.missing)} samples" + _few(status.missing))
    if status.orphans:
        lines.append(
            f"  files of samples the dataset does not have (speculators' trainer "
            f"reads them; `extract --move-orphans` moves them aside): "
            f"{len(status.orphans)}" + _few(status.orphans)
        )
    if status.changed:
        lines.append(
            f"  written from a record the dataset has changed since (a rerun "
            f"checks their tokens and rewrites what differs; verify --all "
            f"compares them): {len(status.changed)}" + _few(status.changed)
        )
    if status.foreign:
        lines.append(
            f"  files speculators' trainer would read that are no sample's "
            f"(it reads every name ending in pt under OUT; move or rename "
            f"them): {len(status.foreign)}" + _few_names(status.foreign)
        )
    if status.unproven:
        lines.append(
            f"  not proven by any manifest (a rerun rewrites them): "
            f"{len(status.unproven)}" + _few(status.unproven)
        )
    for shard, (done, expected) in status.per_shard.items():
        of = "?" if expected < 0 else str(expected)
        lines.append(f"  shard {shard}: {done} of {of} samples")
    rates = []
    for run in status.runs:
        rate = run.tokens_per_second
        state = "live" if run.live else "ended"
        if run.shard:  # which shard it was (extract --shard, --data-parallel)
            state += f", shard {run.shard[0]}/{run.shard[1]}"
        shown = "-" if rate is None else f"{rate:,.0f} tok/s"
        lines.append(f"  run {run.run} ({state}): {run.samples} samples, {shown}")
        if run.live and rate:
            rates.append(run.samples / (run.last - run.first))
    if rates and status.total is not None:
        left = status.total - status.done
        eta = left / sum(rates)
        when = time.ctime(time.time() + eta)
        lines.append(f"  ETA at the live runs' pace: {eta:,.0f} s ({when})")
    lines.append("status: " + ("complete" if status.complete else "INCOMPLETE"))
    return lines


def _few(indices: list[int]) -> str:
    if not indices:
        return ""
    shown = ", ".join(f"data_{i}.pt" for i in indices[:5])
    return f" ({shown}{' ...' if len(indices) > 5 else ''})"
