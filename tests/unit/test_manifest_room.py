"""A run's manifest written into zero-filled room: making its lines durable is
an fdatasync that changes no metadata (no journal commit to wait for), its
readers stop at the zeros, and a closed run's manifest is plain JSON lines."""

from __future__ import annotations

import errno
import json
import logging
import os
import time

import pytest

from specshim.job.extract import parallel
from specshim.job.extract.parallel import Slot
from specshim.job.outdir import manifest_room as _room
from specshim.job.outdir import store as _store
from specshim.job.outdir.manifest import read_manifest


def _entry(index: int) -> _store.Entry:
    return _store.Entry(index, "aa" * 8, "bb" * 8, 4096, 17 + index, 1_000, 250, False)


def _line(index: int) -> str:
    return json.dumps(list(_entry(index).__dict__.values()))


def _run(tmp_path) -> _store.Run:
    _store.prepare_out(tmp_path)
    return _store.Run(tmp_path, {"shard": [0, 1]})


def test_a_live_manifest_ends_in_zeros_its_readers_skip_and_close_cuts(
    tmp_path, caplog
):
    run = _run(tmp_path)
    run.record(*(_entry(i) for i in range(3)))
    raw = run.manifest.read_bytes()
    lines = raw.rstrip(b"\0")
    assert len(raw) == _room.ROOM and raw[len(lines) :] == bytes(len(raw) - len(lines))
    assert lines.endswith(b"\n") and b"\0" not in lines
    with caplog.at_level(logging.WARNING):
        header, entries = read_manifest(run.manifest)
    assert [e.index for e in entries] == [0, 1, 2] and header["shard"] == [0, 1]
    assert not caplog.records, "the room's zeros read as a damaged line"
    run.close()
    assert run.manifest.read_bytes() == lines
    assert [e.index for e in read_manifest(run.manifest)[1]] == [0, 1, 2]


def test_lines_are_made_durable_without_growing_the_file(tmp_path, monkeypatch):
    """Each record is one fdatasync; the file's size, which a fsync would
    have to commit to the journal, changes only when the room grows (a fsync
    then, once per room)."""
    monkeypatch.setattr(_room, "ROOM", 1024)
    calls: list[tuple[str, int]] = []
    fsync, fdatasync = os.fsync, os.fdatasync

    def spy(name, real):
        def call(fd):
            calls.append((name, os.fstat(fd).st_size))
            return real(fd)

        return call

    monkeypatch.setattr(os, "fsync", spy("fsync", fsync))
    monkeypatch.setattr(os, "fdatasync", spy("fdatasync", fdatasync))
    run = _run(tmp_path)
    for index in range(40):
        run.record(_entry(index))
    run.close()
    size = run.manifest.stat().st_size  # the lines alone
    grew = [s for name, s in calls if name == "fsync"]
    synced = [s for name, s in calls if name == "fdatasync"]
    assert len(synced) == 40
    assert len(grew) == -(-size // 1024) and grew == sorted(set(grew))
    assert all(s % 1024 == 0 and s in grew for s in synced)
    assert [e.index for e in read_manifest(run.manifest)[1]] == list(range(40))


def test_a_line_a_crash_tore_in_the_room_is_skipped_without_a_warning(tmp_path, caplog):
    """A crash may keep a later page of unsynced lines and lose an earlier
    one: the lost part reads as zeros. No file was renamed on such a line's
    word, so it is skipped like a torn last line; whole lines still count."""
    lines = [json.dumps({"run": "h-1-ab"}), _line(0)]
    torn = "\0" * 40 + "1000, 250, false]"
    tail = _line(2)
    path = tmp_path / "h-1-ab.jsonl"
    path.write_text("\n".join([*lines, torn, tail]) + "\n" + "\0" * 100)
    with caplog.at_level(logging.WARNING):
        _, entries = read_manifest(path)
    assert [e.index for e in entries] == [0, 2]
    assert not caplog.records


def test_the_data_parallel_tally_waits_at_the_zeros_for_the_next_lines(tmp_path):
    """``--data-parallel``'s parent tails each child's manifest: it stops
    before the room's zeros, so lines laid there later are counted."""
    run = _run(tmp_path)
    child = parallel._Child(
        Slot((0, 1), None),
        process=type("P", (), {"pid": os.getpid()})(),
        log=None,
        started=time.time(),
    )
    run.record(_entry(0), _entry(1))
    child.read_manifest(tmp_path)
    run.record(_entry(2))
    child.read_manifest(tmp_path)
    run.close()
    assert (child.samples, child.tokens) == (3, 750)


def test_a_failed_fsync_of_the_room_fails_every_later_sync(tmp_path, monkeypatch):
    """Linux reports a write-back error once per open file: the room's fsync
    may take it from lines not yet synced, whose later fdatasync would then
    return 0. So the room's failure fails every later sync, and nothing is
    renamed on those lines. No entries, no line."""
    monkeypatch.setattr(_room, "ROOM", 1024)
    run = _run(tmp_path)
    run.record(_entry(0))
    run.append()
    run.append(_entry(1))  # not yet durable
    fsync = os.fsync

    def failing(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(OSError):
        run.append(*(_entry(i) for i in range(2, 40)))  # the room must grow
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="the manifest could not be made durable"):
        run.sync()
    run.close()
    assert b"\n\n" not in run.manifest.read_bytes()
