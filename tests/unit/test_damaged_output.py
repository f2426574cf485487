"""Damaged and foreign files in an extract's output directory (issue 36).

Every command that reads one (``verify``, ``status``, a resumed ``extract``,
``export``) names the file and what is wrong in one line instead of ending in
a traceback, still prints the rest of its report, and loses nothing already
written. The outputs here are written by the real store and writer, without a
generator or a feed process, so each test stays fast.
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import time
import zipfile
from array import array
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from specshim._base import SpecShimError
from specshim.cli import main
from specshim.job import extract as _extract
from specshim.job import store as _store
from specshim.job.checkpoint import hidden_size, model_fingerprint
from specshim.job.export import MARKER
from specshim.job.feed import Todo
from specshim.job.options import ExtractOptions
from specshim.job.run_config import output_config, run_identity
from specshim.job.writer import commit, prepare_sample

LAYERS = [1, 3, 5]  # the tiny Llama has 6 decoder layers and 320 token ids
MAX_LEN = 64


def _states(ids: list[int], width: int) -> list[torch.Tensor]:
    """Layer k's state of token t: a function of (t, k), as a model's would be."""
    return [
        torch.stack([torch.full((width,), float(t + k)) for t in ids]) for k in LAYERS
    ]


def _fabricate(tmp_path: Path, model: Path, count: int) -> tuple[Path, Path]:
    """An output of ``count`` samples written as ``extract`` writes them, and
    its dataset. Sample i starts with token 300 + i (over 255: it does not fit
    a uint8)."""
    width = hidden_size(model)
    records = [{"input_ids": [300 + i, *range(1, 2 + i)]} for i in range(count)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    _store.prepare_out(out)
    run = _store.Run(out, {"shard": [0, 1]})
    identity = run_identity(model_fingerprint(model), LAYERS, MAX_LEN)
    run.publish_config(output_config(identity, model, 1))
    prepared = []
    for index, record in enumerate(records):
        ids, mask = record["input_ids"], [1] * len(record["input_ids"])
        todo = Todo(
            index,
            f"{data}:{index + 1}",
            _store.record_digest(record),
            _store.token_digest(ids, mask),
            array("i", ids),
            array("b", mask),
        )
        result = {"input_ids": torch.tensor(ids), "hidden_states": _states(ids, width)}
        prepared.append(prepare_sample(run, todo, result))
    commit(run, prepared)
    run.annotate({"dataset_samples": count, "finished": time.time()})
    run.close()
    return out, data


# -- the runs' manifests ------------------------------------------------------


def _manifest(out: Path) -> Path:
    (path,) = (out / _store.META / "manifest").glob("*.jsonl")
    return path


def _edit_entry(out: Path, index: int, field: int, value: Any) -> None:
    """Set one field of the manifest line that records sample ``index``."""
    path = _manifest(out)
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines):
        fields = json.loads(line)
        if isinstance(fields, list) and fields[0] == index:
            fields[field] = value
            lines[number] = json.dumps(fields)
    path.write_text("\n".join(lines) + "\n")


def _edit_header(out: Path, key: str, value: Any) -> None:
    path = _manifest(out)
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    header[key] = value
    lines[0] = json.dumps(header)
    path.write_text("\n".join(lines) + "\n")


def _append(out: Path, raw: bytes) -> None:
    with _manifest(out).open("ab") as handle:
        handle.write(raw + b"\n")


# Damage that parses as JSON but not as specshim wrote it, and lines that do
# not parse at all (not as a torn last line does). Each used to end in a
# traceback from `status` or crash a resumed extract's feed as "a specshim bug".
# The flag: the line that proves data_2.pt is the one damaged.
MANIFEST_DAMAGE = {
    "tokens not hex": (lambda out: _edit_entry(out, 2, 1, "zz"), True),
    "tokens null": (lambda out: _edit_entry(out, 2, 1, None), True),
    "index a string": (lambda out: _edit_entry(out, 2, 0, "2"), True),
    "index a list": (lambda out: _edit_entry(out, 2, 0, [2]), True),
    "token count a string": (lambda out: _edit_entry(out, 2, 6, "five"), True),
    "shard 0/0": (lambda out: _edit_header(out, "shard", [0, 0]), False),
    "shard a string": (lambda out: _edit_header(out, "shard", "all"), False),
    "shard a number": (lambda out: _edit_header(out, "shard", 3), False),
    "started a word": (lambda out: _edit_header(out, "started", "yesterday"), False),
    "dataset size a word": (
        lambda out: _append(out, b'{"dataset_samples": "four"}'),
        False,
    ),
    "a 5000-digit number": (lambda out: _append(out, b"1" * 5000), False),
    "nested 100000 deep": (lambda out: _append(out, b"[" * 100_000), False),
}


@pytest.mark.parametrize(
    ("damage", "unproves_data_2"), MANIFEST_DAMAGE.values(), ids=MANIFEST_DAMAGE
)
def test_status_skips_a_damaged_manifest_line_and_says_so(
    tmp_path, tiny_model_dir, capsys, caplog, damage, unproves_data_2
):
    out, _ = _fabricate(tmp_path, tiny_model_dir("llama"), 4)
    damage(out)
    with caplog.at_level(logging.WARNING):
        code = main(["status", "--out", str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert code in (0, 1) and lines[-1].startswith("status: "), lines
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(_manifest(out)) in m and "damaged" in m for m in warned), warned
    unproven = [line for line in lines if "not proven by any manifest" in line]
    assert bool(unproven) == unproves_data_2, lines
    assert all(line.endswith("(data_2.pt)") for line in unproven), lines


def test_a_resumed_extract_rewrites_what_damaged_lines_described(
    tmp_path, tiny_model_dir, monkeypatch
):
    """It used to stop at once: 'reading the dataset failed unexpectedly
    (ValueError: non-hexadecimal number ...): a specshim bug'."""
    model = tiny_model_dir("llama")
    out, data = _fabricate(tmp_path, model, 4)
    kept = _store.final_path(out, 0).stat().st_mtime_ns
    _edit_entry(out, 1, 0, "1")
    _edit_entry(out, 2, 1, "zz")
    _append(out, b"1" * 5000)
    width = hidden_size(model)

    class Generator:
        executor = None

        def generate(self, batch: list[list[int]]) -> list[dict[str, Any]]:
            return [
                {"input_ids": torch.tensor(ids), "hidden_states": _states(ids, width)}
                for ids in batch
            ]

        def shutdown(self) -> None:
            pass

    monkeypatch.setattr(_extract, "_make_generator", lambda *_: Generator())
    monkeypatch.setattr(_extract, "on_cpu", lambda: False)
    options = ExtractOptions(
        model=model, data=data, out=out, layers=LAYERS, max_model_len=MAX_LEN
    )
    counts = _extract.extract(options)
    assert (counts["written"], counts["skipped"]) == (2, 2)
    assert _store.final_path(out, 0).stat().st_mtime_ns == kept  # nothing lost
    assert main(["status", "--out", str(out)]) == 0


# -- data_config.json and the store's leftovers --------------------------------


@pytest.mark.parametrize(
    "text", ["1" * 5000, "[" * 100_000], ids=["5000 digits", "nested"]
)
def test_a_data_config_json_cannot_decode_is_one_line(tmp_path, text, capsys):
    _store.prepare_out(tmp_path)
    (tmp_path / _store.CONFIG_NAME).write_text(text)
    with pytest.raises(SpecShimError, match="is corrupt"):
        _store.read_config(tmp_path)
    assert main(["status", "--out", str(tmp_path)]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "data_config.json is corrupt" in line


def test_a_folder_named_like_a_dead_runs_temporary_file_is_left_alone(tmp_path):
    """Not specshim's (it writes files), so a resumed extract does not stop on it
    with IsADirectoryError."""
    _store.prepare_out(tmp_path)
    folder = tmp_path / ".data_3.pt.otherhost-18-dd.partial"
    folder.mkdir()
    stray = tmp_path / ".data_4.pt.otherhost-18-dd.partial"
    stray.write_bytes(b"x")
    run = _store.Run(tmp_path)
    assert run.remove_dead_partials() == 1
    assert folder.is_dir() and not stray.exists()


# -- verify -------------------------------------------------------------------


def _sample(ids: Any, width: int = 256, layers: int = len(LAYERS)) -> dict[str, Any]:
    ids = torch.as_tensor(ids)
    return {
        "input_ids": ids,
        "loss_mask": torch.ones(len(ids), dtype=torch.long),
        "hidden_states": [torch.zeros(len(ids), width) for _ in range(layers)],
    }


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _zip_of_text() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("notes.txt", "not a torch archive")
    return buffer.getvalue()


# What a user, a tool or a failing disk can leave under a sample's name.
NOT_SAMPLES = {
    "text": b"hello\n",
    "empty": b"",
    "stray bytes": b"h\xe1\xa3\x19",
    "zip, not torch": _zip_of_text(),
    "pickle of a list": pickle.dumps([1, 2, 3]),
    "bool input_ids": _torch_bytes(_sample([True] * 7)),  # sample 5 has 7 ids
    "uint8 input_ids": _torch_bytes(_sample(torch.tensor([44, 1], dtype=torch.uint8))),
    "ids past the vocabulary": _torch_bytes(_sample([1, 10**9])),
    "negative ids": _torch_bytes(_sample([1, -5])),
    "no tokens": _torch_bytes(_sample(torch.zeros(0, dtype=torch.long))),
}


@pytest.fixture
def damaged(tmp_path, tiny_model_dir):
    """An output whose sample i is replaced by the i-th kind of NOT_SAMPLES."""
    model = tiny_model_dir("llama")
    out, data = _fabricate(tmp_path, model, len(NOT_SAMPLES))
    for index, content in enumerate(NOT_SAMPLES.values()):
        _store.final_path(out, index).write_bytes(content)
    return model, out, data


def _bad_lines(text: str) -> dict[str, str]:
    found = {}
    for line in text.splitlines():
        if line.startswith("  BAD "):
            name, _, why = line[len("  BAD ") :].partition(": ")
            found[name] = why
    return found


def test_verify_all_names_every_file_that_is_no_sample(damaged, capfd):
    model, out, data = damaged
    code = main(
        ["verify", "--model", str(model), "--out", str(out), "--all"]
        + ["--data", str(data)]
    )
    text = capfd.readouterr().out
    assert code == 1 and text.rstrip().endswith("verify: FAILED"), text
    bad = _bad_lines(text)
    assert sorted(bad) == sorted(f"data_{i}.pt" for i in range(len(NOT_SAMPLES)))
    assert "not a torch file" in bad["data_0.pt"] and "'hello" in bad["data_0.pt"]
    assert "is empty" in bad["data_1.pt"]
    assert "not token ids" in bad["data_5.pt"]  # bool ids are no token ids


def test_verify_samples_reports_files_that_are_no_sample_as_bad(damaged, capfd):
    """The HF reference is never run on them: ids past the vocabulary, negative
    ids, bool ids or no tokens at all would end in the embedding's IndexError
    or RuntimeError. (uint8 ids are token ids: that sample is compared, and
    its zero states disagree.)"""
    model, out, _ = damaged
    code = main(
        ["verify", "--model", str(model), "--out", str(out)]
        + ["--samples", str(len(NOT_SAMPLES)), "--reference", "hf"]
    )
    text = capfd.readouterr().out
    assert code == 1 and text.rstrip().endswith("verify: FAILED"), text
    assert "  layer   mean cosine" in text  # the rest of the report is there
    bad = _bad_lines(text)
    names = [f"data_{i}.pt" for i in range(len(NOT_SAMPLES)) if i != 6]
    assert sorted(bad) == sorted(names)
    assert "not a torch file" in bad["data_0.pt"]
    assert "outside the model's vocabulary" in bad["data_7.pt"]
    assert "outside the model's vocabulary" in bad["data_8.pt"]
    assert "no tokens" in bad["data_9.pt"]
    mismatched = [line for line in text.splitlines() if "MISMATCH" in line]
    assert len(mismatched) == 1 and "MISMATCH data_6.pt: " in mismatched[0]


# -- export -------------------------------------------------------------------


def _vouch_for(out: Path, index: int, content: bytes) -> None:
    """Replace data_{index}.pt and record the new file as its own run did:
    damage the manifest cannot see (bit rot, an edit that kept the file's
    size and times), which only reading the file finds."""
    entry = next(e for e in _store.manifest_lines(out) if e.index == index)
    path = _store.final_path(out, index)
    path.write_bytes(content)
    stat = path.stat()
    run = _store.Run(out)
    run.record(
        replace(entry, size=stat.st_size, inode=stat.st_ino, mtime_ns=stat.st_mtime_ns)
    )
    run.close()


def _export(out: Path, dest: Path, model: Path, dtype: str = "source") -> int:
    return main(
        ["export", "--out", str(out), "--to", "speculators", str(dest)]
        + ["--model", str(model), "--dtype", dtype]
    )


def _errors(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("specshim export:")]


# Sample 2 is [302, 1, 2]. Each of these used to be exported as if whole
# (the table and the marker written), or end in torch.stack's RuntimeError.
SOURCE_DAMAGE = {
    "no hidden states": _torch_bytes(_sample([302, 1, 2], layers=0)),
    "two of three layers": _torch_bytes(_sample([302, 1, 2], layers=2)),
    "states of another width": _torch_bytes(_sample([302, 1, 2], width=8)),
    "other tokens than recorded": _torch_bytes(_sample([302, 1, 3])),
    "ids past the vocabulary": _torch_bytes(_sample([302, 1, 10**9])),
}


@pytest.mark.parametrize("content", SOURCE_DAMAGE.values(), ids=SOURCE_DAMAGE)
def test_export_refuses_a_source_file_that_does_not_hold_its_sample(
    tmp_path, tiny_model_dir, capsys, content
):
    model = tiny_model_dir("llama")
    out, _ = _fabricate(tmp_path, model, 4)
    _vouch_for(out, 2, content)
    dest = tmp_path / "dest"
    assert _export(out, dest, model) == 1
    (line,) = _errors(capsys.readouterr().err)
    assert "data_2.pt" in line and "delete it" in line, line
    assert not (dest / MARKER).exists()  # not whole, and not said to be


def _damage_export_manifest(dest: Path, raw: bytes) -> None:
    with (dest / ".specshim-export" / "manifest.jsonl").open("ab") as handle:
        handle.write(raw + b"\n")


def _damage_one_agreement(dest: Path) -> None:
    path = dest / ".specshim-export" / "manifest.jsonl"
    lines = path.read_text().splitlines()
    entry = json.loads(lines[1])
    entry["agreement"] = "junk"
    lines[1] = json.dumps(entry)
    path.write_text("\n".join(lines) + "\n")


# (damage to an earlier export, its dtype, exit status of the rerun, written)
DEST_DAMAGE = {
    "marker not JSON": (lambda dest: (dest / MARKER).write_text("junk"), "source", 2),
    "marker a list": (lambda dest: (dest / MARKER).write_text("[1]"), "source", 2),
    "manifest line of stray bytes": (
        lambda dest: _damage_export_manifest(dest, b"\xff\xfe{"),
        "source",
        0,
    ),
    "an fp8 row's agreement": (_damage_one_agreement, "fp8", 0),
}


@pytest.mark.parametrize(
    ("damage", "dtype", "status"), DEST_DAMAGE.values(), ids=DEST_DAMAGE
)
def test_a_damaged_earlier_export_is_refused_or_repaired_never_a_traceback(
    tmp_path, tiny_model_dir, capsys, damage, dtype, status
):
    model = tiny_model_dir("llama")
    out, _ = _fabricate(tmp_path, model, 4)
    dest = tmp_path / "dest"
    assert _export(out, dest, model, dtype) == 0
    damage(dest)
    capsys.readouterr()
    assert _export(out, dest, model, dtype) == status
    captured = capsys.readouterr()
    errors = _errors(captured.err)
    if status:
        (line,) = errors
        assert MARKER in line and "remove" in line, line
        assert len(list((dest / "hidden_states").iterdir())) == 4  # nothing lost
    else:
        assert not errors and (dest / MARKER).is_file()


def test_an_export_to_a_regular_file_is_one_line(tmp_path, tiny_model_dir, capsys):
    model = tiny_model_dir("llama")
    out, _ = _fabricate(tmp_path, model, 2)
    dest = tmp_path / "dest"
    dest.write_text("mine\n")
    assert _export(out, dest, model) == 2
    (line,) = _errors(capsys.readouterr().err)
    assert "is a file" in line and dest.read_text() == "mine\n"
