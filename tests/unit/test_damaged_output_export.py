"""``export`` from a damaged source or onto a damaged earlier export: a file
that does not hold its sample is refused, a damaged export refused or
repaired, never a traceback and never an export said to be whole.

Issue 36: a command that reads a damaged file names it and what is wrong
in one line, never a traceback, and loses nothing already written.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from specshim.cli import main
from specshim.job.export.command import MARKER
from specshim.job.outdir import store as _store

from ._damaged_output_helpers import (
    _fabricate,
    _sample,
    _torch_bytes,
)


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
