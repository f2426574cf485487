"""The writer's committer: one fsync of the manifest for every batch waiting
(group commit), off the writer's thread, and never a file under its final
name before a fsync that covers its manifest line has returned."""

from __future__ import annotations

import errno
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from specshim._base import SpecShimError
from specshim.job.extract import committer as _committer
from specshim.job.extract.command import extract
from specshim.job.outdir import store as _store
from specshim.job.outdir.manifest import read_manifest

from ._pipeline_helpers import (
    _jsonl,
    _options,
    _written,
    fake_fixture,  # noqa: F401 - the fixture `fake`
)

SAMPLES = 40  # ten batches of four


def _data(tmp_path: Path) -> Path:
    rows = [{"input_ids": [i + 1, i + 2]} for i in range(SAMPLES)]
    return _jsonl(tmp_path / "d.jsonl", rows)


def _index(path: Any) -> int:
    return int(Path(path).stem.split("_")[1])


def test_a_slow_fsync_covers_the_batches_that_queued_behind_it(
    tmp_path, tiny_model_dir, fake, monkeypatch
):
    """Each fsync here takes 0.2 s, as on a host busy writing states: the
    batches serialized meanwhile wait for the next one, which covers them all
    (fewer fsyncs than batches), and every file is renamed into place only
    after a fsync that covered its line returned."""
    durable: set[int] = set()
    covered_by_sync: list[int] = []
    early: list[int] = []
    sync = _store.Run.sync

    def slow_sync(run):
        _, entries = read_manifest(run.manifest)  # the lines appended so far
        covered = {entry.index for entry in entries}
        time.sleep(0.2)
        sync(run)
        durable.update(covered)
        covered_by_sync.append(len(covered))

    def replace(src, dst):
        if _index(dst) not in durable:
            early.append(_index(dst))
        os.replace(src, dst)

    monkeypatch.setattr(_store.Run, "sync", slow_sync)
    monkeypatch.setattr(_committer, "os", SimpleNamespace(replace=replace))
    out = tmp_path / "out"
    counts = extract(_options(tiny_model_dir("llama"), _data(tmp_path), out))
    assert counts["written"] == SAMPLES
    assert sorted(_written(out)) == list(range(SAMPLES))
    assert early == [], f"renamed before a fsync covered their lines: {early}"
    assert counts["timing"]["writer_syncs"] == len(covered_by_sync)
    assert len(covered_by_sync) < SAMPLES // 4, covered_by_sync
    assert covered_by_sync[-1] == SAMPLES


def test_a_failed_fsync_stops_the_run_and_what_it_published_is_whole(
    tmp_path, tiny_model_dir, fake, monkeypatch
):
    """The second fsync fails: the run stops with one line naming the first
    sample it did not publish, every file before it is in place, none after
    it and no temporary file is left; the same command then resumes."""
    calls: list[int] = []
    sync = _store.Run.sync

    def failing_sync(run):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error")
        sync(run)

    monkeypatch.setattr(_store.Run, "sync", failing_sync)
    model, data, out = tiny_model_dir("llama"), _data(tmp_path), tmp_path / "out"
    with pytest.raises(SpecShimError) as raised:
        extract(_options(model, data, out))
    found = re.match(
        r"writing data_(\d+)\.pt failed \(OSError: .*Input/output error\); the "
        r"run stopped\. The (\d+) samples it wrote are complete",
        str(raised.value),
    )
    assert found, str(raised.value)
    first, wrote = map(int, found.groups())
    assert 0 < first < SAMPLES and first % 4 == 0 and wrote == first
    assert sorted(_written(out)) == list(range(first))
    assert not list(out.glob(".data_*"))
    monkeypatch.setattr(_store.Run, "sync", sync)
    counts = extract(_options(model, data, out))
    assert counts["written"] == SAMPLES - first
    written = _written(out)
    assert written == {i: [i + 1, i + 2] for i in range(SAMPLES)}


def test_a_commit_that_fails_twice_over_still_stops_the_run(
    tmp_path, tiny_model_dir, fake, monkeypatch
):
    """The fsync fails and so does removing the unpublished files (a disk
    gone read-only): the committer must not die without its error, or the
    writer would go on and the run end with samples missing."""
    calls: list[int] = []
    sync, unlink = _store.Run.sync, Path.unlink

    def failing_sync(run):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error")
        sync(run)

    def failing_unlink(path, missing_ok=False):
        if path.name.endswith(".partial") and len(calls) == 2:
            raise OSError(errno.EROFS, "Read-only file system")
        return unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(_store.Run, "sync", failing_sync)
    monkeypatch.setattr(Path, "unlink", failing_unlink)
    out = tmp_path / "out"
    with pytest.raises(SpecShimError, match=r"failed \(OSError: .*Input/output"):
        extract(_options(tiny_model_dir("llama"), _data(tmp_path), out))
    assert len(calls) == 2


def test_samples_handed_over_and_never_published_fail_the_run(
    tmp_path, tiny_model_dir, fake, monkeypatch
):
    """The last line of defence: a writer that ends without an error, yet
    published fewer samples than it was handed, fails the run."""
    from specshim.job.extract.writer import Writer

    published = Writer._published

    def losing(self, renamed):
        published(self, renamed[1:])  # one sample a commit goes uncounted

    monkeypatch.setattr(Writer, "_published", losing)
    with pytest.raises(SpecShimError, match=r"the writer published \d+ of the 40"):
        extract(_options(tiny_model_dir("llama"), _data(tmp_path), tmp_path / "o"))
