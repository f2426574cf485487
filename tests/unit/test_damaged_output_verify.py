"""``verify`` on files that are no sample (text, stray bytes, foreign pickles,
ids no model has): each is one BAD line, and the rest of the report is there.

Issue 36: a command that reads a damaged file names it and what is wrong
in one line, never a traceback, and loses nothing already written.
"""

from __future__ import annotations

import io
import pickle
import zipfile

import pytest
import torch

from specshim.cli import main
from specshim.job.outdir import store as _store

from ._damaged_output_helpers import (
    _fabricate,
    _sample,
    _torch_bytes,
)


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
