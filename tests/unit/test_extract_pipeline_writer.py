"""The writer of ``extract``'s pipeline, with a stand-in generator: writes
overlap generation, a failing writer stops the run, and the closing profile
says where the run's time went."""

from __future__ import annotations

import threading
import time

import pytest

from specshim._base import SpecShimError
from specshim.job.extract import command as _extract
from specshim.job.extract import committer as _committer
from specshim.job.extract import writer as _writer
from specshim.job.extract.command import extract

from ._pipeline_helpers import (
    FakeGenerator,
    _jsonl,
    _options,
    _written,
    fake_fixture,  # noqa: F401 - the fixture `fake`
)


def test_writes_overlap_the_next_generate(tmp_path, tiny_model_dir, fake, monkeypatch):
    """Batch 1's files are written only once batch 2 is generating."""
    model = tiny_model_dir("llama")
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [i + 1]} for i in range(8)])
    second_generate = threading.Event()
    save = _writer.prepare_sample

    def slow_save(run, todo, result):
        if todo.index == 0:
            assert second_generate.wait(60), "batch 2 never started while 1 wrote"
        return save(run, todo, result)

    def make(plan):
        fake.append(FakeGenerator(lambda n: n == 2 and second_generate.set()))
        return fake[-1]

    monkeypatch.setattr(_writer, "prepare_sample", slow_save)
    monkeypatch.setattr(_extract, "_make_generator", make)
    counts = extract(_options(model, data, tmp_path / "out"))
    assert counts["written"] == 8 and second_generate.is_set()


@pytest.mark.parametrize("writers", [1, 3], ids=["one-writer", "a-pool"])
def test_a_failing_writer_stops_the_run(
    tmp_path, tiny_model_dir, fake, monkeypatch, writers
):
    """One writer where vLLM computes on the CPU, a pool on a GPU host: either
    way, the samples before the failure are written and none after it."""
    monkeypatch.setattr(_writer, "writers", lambda: writers)
    model = tiny_model_dir("llama")
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [i + 1]} for i in range(40)])
    save = _writer.prepare_sample

    def failing_save(run, todo, result):
        if todo.index == 9:
            raise OSError(28, "No space left on device")
        return save(run, todo, result)

    monkeypatch.setattr(_writer, "prepare_sample", failing_save)
    out = tmp_path / "out"
    with pytest.raises(SpecShimError, match=r"writing data_9\.pt failed .*No space"):
        extract(_options(model, data, out))
    assert sorted(_written(out)) == list(range(9))
    # Samples 10 and 11 were serialized beside 9; nothing of them is left.
    assert not list(out.glob(".data_*"))
    # Batch 3 (samples 8-11) fails while batch 4 serializes beside it; one
    # batch waiting and one generating at most after those.
    assert fake[0].calls <= 6, "generation went on after the writer failed"


def test_the_run_says_where_its_time_went(
    tmp_path, tiny_model_dir, fake, monkeypatch, caplog
):
    """The closing profile line: a slow generate() shows as generate() time, a
    slow disk as the writer's serializing time and as batches waiting."""
    monkeypatch.setattr(_writer, "writers", lambda: 1)
    save = _writer.prepare_sample

    def slow_save(run, todo, result):
        time.sleep(0.03)
        return save(run, todo, result)

    monkeypatch.setattr(_writer, "prepare_sample", slow_save)
    monkeypatch.setattr(_extract, "_make_generator", lambda plan: _Slow())
    model = tiny_model_dir("llama")
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [i + 1]} for i in range(24)])
    with caplog.at_level("INFO", logger="specshim.job.extract.command"):
        counts = extract(_options(model, data, tmp_path / "out"))
    timing = counts["timing"]
    assert timing["generate"] >= 6 * 0.05  # 6 batches of 4, 50 ms each
    assert timing["writer_serializing"] >= 24 * 0.03 - 0.05  # one thread
    # One thread at 120 ms a batch against 50 ms of generate(): batches wait.
    assert timing["waiting_for_writer"] > 0.1
    assert timing["writer_idle"] < timing["writer_serializing"]
    line = [r.getMessage() for r in caplog.records if "after the first" in r.message]
    assert len(line) == 1 and "for its 1 threads' files" in line[0]


class _Slow(FakeGenerator):
    def generate(self, batch):
        time.sleep(0.05)
        return super().generate(batch)


def test_the_next_batch_serializes_while_one_commits(
    tmp_path, tiny_model_dir, fake, monkeypatch
):
    """The writer's pool is not idle while a batch's manifest lines are
    fsynced: batch 2's first file is serialized while batch 1 commits."""
    monkeypatch.setattr(_writer, "writers", lambda: 2)
    second_batch_saving = threading.Event()
    save, publish = _writer.prepare_sample, _committer.publish

    def slow_save(run, todo, result):
        if todo.index == 4:
            second_batch_saving.set()
        if todo.index == 3:  # batch 1 stays on the pool until batch 2 came
            time.sleep(0.5)
        return save(run, todo, result)

    def waiting_commit(run, prepared, renamed):
        if prepared and prepared[0].todo.index == 0:
            assert second_batch_saving.wait(10), "the pool idled during a commit"
        return publish(run, prepared, renamed)

    monkeypatch.setattr(_writer, "prepare_sample", slow_save)
    monkeypatch.setattr(_committer, "publish", waiting_commit)
    model = tiny_model_dir("llama")
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [i + 1]} for i in range(12)])
    counts = extract(_options(model, data, tmp_path / "out"))
    assert counts["written"] == 12 and second_batch_saving.is_set()
    assert sorted(_written(tmp_path / "out")) == list(range(12))


def test_a_batch_goes_to_the_pool_longest_first_and_commits_in_order(
    tmp_path, tiny_model_dir, fake, monkeypatch
):
    """The pool starts a batch's longest samples first (a long one started
    last would end the batch alone while the other threads idle), ties in
    sample order; the batch is still recorded and renamed in sample order."""
    monkeypatch.setattr(_writer, "writers", lambda: 1)
    started, recorded = [], []
    save, publish = _writer.prepare_sample, _committer.publish

    def saving(run, todo, result):
        started.append(todo.index)
        return save(run, todo, result)

    def committing(run, prepared, renamed):
        recorded.extend(p.todo.index for p in prepared)
        return publish(run, prepared, renamed)

    monkeypatch.setattr(_writer, "prepare_sample", saving)
    monkeypatch.setattr(_committer, "publish", committing)
    lengths = [2, 5, 1, 5, 3, 1, 4, 2]
    rows = [{"input_ids": list(range(1, n + 1))} for n in lengths]
    data = _jsonl(tmp_path / "d.jsonl", rows)
    counts = extract(_options(tiny_model_dir("llama"), data, tmp_path / "out"))
    assert counts["written"] == 8
    assert started == [1, 3, 0, 2, 6, 4, 7, 5]  # batches of 4, longest first
    assert recorded == list(range(8))  # one commit may cover both batches
    written = _written(tmp_path / "out")
    assert [len(written[i]) for i in range(8)] == lengths


def test_the_rate_leaves_out_the_engines_shutdown(
    tmp_path, tiny_model_dir, fake, monkeypatch
):
    """Like start-up, closing vLLM (seconds on a GPU host) is not extraction:
    the rate counts from the first generate() to the last file committed."""
    monkeypatch.setattr(_extract, "_shutdown", lambda generator: time.sleep(1.0))
    model = tiny_model_dir("llama")
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [i + 1]} for i in range(8)])
    counts = extract(_options(model, data, tmp_path / "out"))
    assert counts["written"] == 8
    assert counts["seconds"] < 0.9, counts["seconds"]


def test_writer_threads_follow_the_variable_and_a_bad_one_is_refused_first(
    tmp_path, tiny_model_dir, fake, monkeypatch, caplog
):
    """SPECSHIM_WRITER_THREADS sets the writer's threads (the bench's lever for
    telling writing and generate() apart on a GPU host); a value that is no
    whole number of at least 1 is refused before --out is created."""
    model = tiny_model_dir("llama")
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [i + 1]} for i in range(8)])
    monkeypatch.setenv("SPECSHIM_WRITER_THREADS", "3")
    assert _writer.writers() == 3
    with caplog.at_level("INFO", logger="specshim.job.extract.command"):
        extract(_options(model, data, tmp_path / "out"))
    assert "for its 3 threads' files" in caplog.text
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("SPECSHIM_WRITER_THREADS", bad)
        with pytest.raises(SpecShimError, match=f"SPECSHIM_WRITER_THREADS={bad}: "):
            extract(_options(model, data, tmp_path / "refused"))
        assert not (tmp_path / "refused").exists()
