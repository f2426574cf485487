"""The output directory's bookkeeping: whose temporary files may be removed,
which settings win, and which files are proven by the manifest."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from specshim.job.outdir import store as _store


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_only_dead_runs_lose_their_temporary_files(tmp_path):
    _store.prepare_out(tmp_path)
    run = _store.Run(tmp_path)
    run.start()
    try:
        here = run.host
        files = {
            "mine": run.partial_path("data_1.pt"),
            "dead_here": tmp_path / f".data_2.pt.{here}-{_dead_pid()}-aa.partial",
            "live_here": tmp_path / f".data_3.pt.{here}-{os.getppid()}-bb.partial",
            "live_there": tmp_path / ".data_4.pt.otherhost-17-cc.partial",
            "dead_there": tmp_path / ".data_5.pt.otherhost-18-dd.partial",
        }
        for path in files.values():
            path.write_bytes(b"x")
        beats = tmp_path / _store.META / "runs"
        (beats / f"{here}-{os.getppid()}-bb").write_text("{}")
        (beats / "otherhost-17-cc").write_text("{}")
        (beats / "otherhost-18-dd").write_text("{}")
        old = time.time() - 2 * _store.STALE_AFTER
        os.utime(beats / "otherhost-18-dd", (old, old))
        assert run.remove_dead_partials() == 2
        left = {name for name, path in files.items() if path.exists()}
        assert left == {"mine", "live_here", "live_there"}
        assert not (beats / "otherhost-18-dd").exists()
    finally:
        run.close()
    assert not files["mine"].exists()  # a run removes its own on the way out
    assert not run.heartbeat.exists()


def test_the_first_run_fixes_the_settings(tmp_path):
    _store.prepare_out(tmp_path)
    first, second = _store.Run(tmp_path), _store.Run(tmp_path)
    assert first.publish_config({"layers": [1]}) == {"layers": [1]}
    assert second.publish_config({"layers": [2]}) == {"layers": [1]}
    assert not list(tmp_path.glob(".*.partial"))


def test_a_file_is_proven_only_as_it_was_recorded(tmp_path):
    _store.prepare_out(tmp_path)
    run = _store.Run(tmp_path)
    for index in (0, 1, 2):
        tmp = run.partial_path(f"data_{index}.pt")
        tmp.write_bytes(b"0123456789")
        stat = tmp.stat()
        run.record(
            _store.Entry(
                index, "aa", "bb", stat.st_size, stat.st_ino, stat.st_mtime_ns, 3
            )
        )
        os.replace(tmp, _store.final_path(tmp_path, index))
    run.close()
    with open(_store.final_path(tmp_path, 1), "r+b") as handle:
        handle.truncate(5)
    _store.final_path(tmp_path, 2).write_bytes(b"9876543210")  # same size, new file
    files = _store.existing_files(tmp_path)
    assert sorted(_proven(tmp_path, files)) == [0]
    # A torn last line (a run killed mid-write) is skipped, not fatal.
    with run.manifest.open("a") as handle:
        handle.write('[3, "aa", "bb"')
    assert sorted(_proven(tmp_path, files)) == [0]


def test_sample_fingerprints_see_tokens_and_mask():
    base = _store.token_digest([1, 2, 3], [1, 1, 1])
    assert base == _store.token_digest([1, 2, 3], [1, 1, 1])
    assert base != _store.token_digest([1, 2, 4], [1, 1, 1])
    assert base != _store.token_digest([1, 2, 3], [0, 1, 1])
    assert _store.record_digest({"a": 1, "b": [2]}) == _store.record_digest(
        {"b": [2], "a": 1}
    )


def _proven(out, files):
    """Index -> the entry that proves each existing file (the store's rule)."""
    entries = list(_store.manifest_lines(out))
    found = {}
    for index, stat in files.items():
        same = [e for e in entries if e.index == index]
        entry = _store.proving(same, stat, _store.Entry.file_identity)
        if entry is not None:
            found[index] = entry
    return found


def test_a_runs_folder_that_cannot_be_written_is_one_line(tmp_path, monkeypatch):
    """(root ignores permission bits, so the refusal is simulated at the write)"""
    from pathlib import Path

    from specshim._base import UsageError

    _store.prepare_out(tmp_path)
    write = Path.write_text

    def refuse(path, *args, **kwargs):
        if path.parent.name == "runs":
            raise PermissionError(13, "Permission denied")
        return write(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", refuse)
    run = _store.Run(tmp_path)
    with pytest.raises(UsageError, match=r"cannot write .*runs \(Permission denied\)"):
        run.start()
