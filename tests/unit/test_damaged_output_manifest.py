"""Damaged run manifests, a damaged data_config.json and foreign leftovers in
OUT: ``status`` skips a damaged manifest line and says so, a resumed
``extract`` rewrites what it described, a config it cannot decode is one line.

Issue 36: a command that reads a damaged file names it and what is wrong
in one line, never a traceback, and loses nothing already written.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from specshim._base import SpecShimError
from specshim.cli import main
from specshim.job.extract import command as _extract
from specshim.job.extract.options import ExtractOptions
from specshim.job.inputs.checkpoint import hidden_size
from specshim.job.outdir import store as _store
from specshim.job.outdir.data_config import (
    CONFIG_NAME,
    read_config,
)

from ._damaged_output_helpers import (
    LAYERS,
    MAX_LEN,
    _fabricate,
    _states,
)

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
    (tmp_path / CONFIG_NAME).write_text(text)
    with pytest.raises(SpecShimError, match="is corrupt"):
        read_config(tmp_path)
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
