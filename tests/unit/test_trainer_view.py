"""What speculators' trainer reads is what ``verify --all`` vouches for.

speculators 0.3.0 lists its data with ``speculators.train.data.list_files``:
every file in every folder under OUT, hidden ones too, whose name ends in
``pt``. The rule (issue 48): ``verify --all`` exits 0 only when that list is
exactly the dataset's samples' files, each one proven; anything else it names
under its real name and exits 1. Random OUT trees, built from a real extract's
output, check the rule against the trainer's own function.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specshim.cli import main
from specshim.job import status as _status
from specshim.job.extract import command as _extract

from ._pipeline_helpers import _jsonl, _options
from .test_export import LayeredGenerator

SAMPLES = 5

# Each change to OUT, and whether the trainer would still read exactly the
# dataset's proven files after it.
CHANGES = {
    "foreign name": ("notes.pt", False),
    "zero-padded copy": ("data_01.pt", False),
    "zero-padded orphan": ("data_007.pt", False),
    "name ending in pt": ("model.ckpt", False),
    "in a hidden folder": (".cache/data_1.pt", False),
    "in specshim's folder": (".specshim/orphans/old/data_9.pt", False),
    "orphan": (f"data_{SAMPLES + 1}.pt", False),
    "folder named like a sample": (f"data_{SAMPLES + 2}.pt/", True),
    "other name": ("README.md", True),
    "moved orphan": (".specshim/orphans/old/data_9.pt.orphan", True),
    "torn": ("data_2.pt~torn", False),
    "missing": ("data_3.pt~gone", False),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_model_dir):
    """One extract's OUT (a generator whose states are a function of the
    token and the layer, as wide as the model)."""
    from specshim.job.inputs.checkpoint import hidden_size

    model = tiny_model_dir("llama")
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(
        _extract,
        "_make_generator",
        lambda plan: LayeredGenerator(list(plan.layers), hidden_size(model)),
    )
    monkeypatch.setattr(_extract, "on_cpu", lambda: False)
    root = tmp_path_factory.mktemp("trainer-view")
    rows = [{"input_ids": [i + 1, i + 2, i + 3]} for i in range(SAMPLES)]
    data = _jsonl(root / "d.jsonl", rows)
    _extract.extract(_options(model, data, root / "out"))
    monkeypatch.undo()
    return model, data, root / "out"


def _apply(out: Path, change: str) -> None:
    path, _ = CHANGES[change]
    if path.endswith("~torn"):
        target = out / path.removesuffix("~torn")
        head = target.read_bytes()[:100]
        target.unlink()  # the source's file is linked: never written here
        target.write_bytes(head)
    elif path.endswith("~gone"):
        (out / path.removesuffix("~gone")).unlink()
    elif path.endswith("/"):
        (out / path).mkdir(parents=True)
    else:
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(out / "data_1.pt", out / path)


@settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(changes=st.sets(st.sampled_from(sorted(CHANGES)), max_size=4))
def test_verify_vouches_for_exactly_what_the_trainer_reads(
    source, tmp_path_factory, changes
):
    from speculators.train.data import list_files

    model, data, base = source
    out = tmp_path_factory.mktemp("case") / "out"
    # Linked, not copied: the manifests prove a file by its inode and mtime.
    shutil.copytree(base, out, copy_function=os.link)
    for change in sorted(changes):
        _apply(out, change)
    code = main(
        ["verify", "--all", "--out", str(out), "--data", str(data)]
        + ["--model", str(model)]
    )
    read = {str(p) for p in list_files(out)}
    samples = {str(out / f"data_{i}.pt") for i in range(SAMPLES)}
    whole = all(CHANGES[change][1] for change in changes)
    assert (code == 0) == whole, f"{sorted(changes)}: verify --all exited {code}"
    if code == 0:  # what it vouched for is what the trainer reads
        assert read == samples
    status = _status.collect(out, data)
    assert status.complete == whole, sorted(changes)


def test_status_and_verify_agree_on_an_edited_dataset(source, tmp_path):
    """status said complete where verify --all found a sample that no longer
    matched its record (issue 48)."""
    import json

    model, data, base = source
    out = tmp_path / "out"
    shutil.copytree(base, out, copy_function=os.link)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    rows[3]["input_ids"] = [7, 7, 7]
    edited = _jsonl(tmp_path / "edited.jsonl", rows)
    status = _status.collect(out, edited)
    assert status.changed == [3] and not status.complete
    assert "written from a record the dataset has changed" in "\n".join(
        _status.render(status, out)
    )
    code = main(
        ["verify", "--all", "--out", str(out), "--data", str(edited)]
        + ["--model", str(model)]
    )
    assert code == 1
    assert _status.collect(out, data).complete  # against the data it was written from


def test_a_zero_padded_name_is_named_as_it_is_and_never_taken_for_a_sample(
    source, tmp_path, caplog
):
    """With --move-orphans the run said it moved data_7.pt while data_007.pt
    stayed, and verify --all then reported an orphan data_7.pt that did not
    exist (issue 48)."""
    import logging

    model, data, base = source
    out = tmp_path / "out"
    shutil.copytree(base, out, copy_function=os.link)
    shutil.copy(out / "data_1.pt", out / "data_007.pt")
    with caplog.at_level(logging.WARNING):
        _extract.extract(_options(model, data, out, move_orphans=True))
    assert "data_007.pt" in caplog.text and "data_7.pt" not in caplog.text
    assert (out / "data_007.pt").exists()
    status = _status.collect(out, data)
    assert status.foreign == ["data_007.pt"] and status.orphans == []
    assert not status.complete
