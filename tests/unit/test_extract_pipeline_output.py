"""What ``extract``'s pipeline leaves in OUT, with a stand-in generator: the
samples and counts, shards (also from Slurm's and Kubernetes' variables),
and files of samples a shorter dataset lacks, never counted done."""

from __future__ import annotations

import pytest

from specshim._base import UsageError
from specshim.job import status as _status
from specshim.job.extract.command import extract
from specshim.job.outdir import store as _store

from ._pipeline_helpers import (
    _jsonl,
    _options,
    _written,
    fake_fixture,  # noqa: F401 - the fixture `fake`
)


def test_output_and_counts(tmp_path, tiny_model_dir, fake):
    model = tiny_model_dir("llama")
    rows = [{"input_ids": list(range(1, 2 + i % 7))} for i in range(11)]
    data = _jsonl(tmp_path / "d.jsonl", rows)
    out = tmp_path / "out"
    counts = extract(_options(model, data, out, shard=(1, 2)))
    assert counts["written"] == 5 and counts["dataset_samples"] == 11
    assert counts["shard_samples"] == 5 and counts["skipped"] == 0
    assert _written(out) == {i: rows[i]["input_ids"] for i in range(1, 11, 2)}
    assert fake[0].calls == 2  # batches of 4 and 1
    # The run recorded the dataset's size: status needs no --data to count.
    headers = [h for h, _ in _store.manifests(out)]
    assert headers[0]["dataset_samples"] == 11 and headers[0]["shard"] == [1, 2]
    half = _status.collect(out)
    assert (half.total, half.done, half.complete) == (11, 5, False)
    extract(_options(model, data, out, shard=(0, 2)))
    assert _status.collect(out).complete


def test_shard_auto_from_slurm_and_kubernetes_covers_the_dataset(
    tmp_path, tiny_model_dir, fake, monkeypatch, capsys
):
    from specshim.cli import main

    model = tiny_model_dir("llama")
    data = _jsonl(tmp_path / "d.jsonl", [{"input_ids": [i + 1]} for i in range(7)])
    out = tmp_path / "out"
    command = ["extract", "--model", str(model), "--data", str(data)]
    command += ["--out", str(out), "--layers", "1", "--shard", "auto"]
    for name in ("SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "2")
    assert main(command) == 0
    assert sorted(_written(out)) == [1, 3, 5]
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "0")
    monkeypatch.setenv("SPECSHIM_SHARD_COUNT", "2")
    assert main(command) == 0
    assert sorted(_written(out)) == list(range(7))
    capsys.readouterr()
    assert main(["status", "--out", str(out)]) == 0
    assert "shard 0/2: 4 of 4 samples" in capsys.readouterr().out


def test_files_of_samples_a_shorter_dataset_lacks_are_never_counted_done(
    tmp_path, tiny_model_dir, fake
):
    """speculators' trainer reads every .pt in OUT: a rerun on a shorter
    dataset must not leave the old tail in place looking finished."""
    model = tiny_model_dir("llama")
    rows = [{"input_ids": [i + 1, i + 2]} for i in range(6)]
    data, out = _jsonl(tmp_path / "d.jsonl", rows), tmp_path / "out"
    extract(_options(model, data, out))
    _jsonl(data, rows[:4])
    with pytest.raises(UsageError, match=r"2 file\(s\) of samples .* --move-orphans"):
        extract(_options(model, data, out))
    assert sorted(_written(out)) == [0, 1, 2, 3, 4, 5]  # nothing removed unasked
    status = _status.collect(out)
    assert (status.total, status.done, status.orphans) == (4, 4, [4, 5])
    assert not status.complete
    assert "files of samples the dataset does not have" in "\n".join(
        _status.render(status, out)
    )
    extract(_options(model, data, out, move_orphans=True))
    assert sorted(_written(out)) == [0, 1, 2, 3]
    orphans = (out / ".specshim" / "orphans").rglob("*")
    moved = sorted(p.name for p in orphans if p.is_file())
    assert moved == ["data_4.pt.orphan", "data_5.pt.orphan"]
    # The trainer walks every folder and reads every name ending in pt: the
    # moved files were still among them (issue 48).
    from speculators.train.data import list_files

    assert sorted(p.name for p in list_files(out)) == [f"data_{i}.pt" for i in range(4)]
    assert _status.collect(out).complete
