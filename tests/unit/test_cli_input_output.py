"""The output side of ``extract``/``verify``: an unusable ``--out``, a corrupt
``data_config.json``, and the closing summary's wording."""

from __future__ import annotations

from pathlib import Path

import pytest

from specshim.cli import main

from ._cli_input_helpers import (
    OK_LINE,
    _data,
    _extract_one,
    _one_line_error,
    model_fixture,  # noqa: F401 - the model fixture
)


def test_out_is_a_file(tmp_path, capsys, model):
    target = tmp_path / "taken"
    target.write_text("x")
    code, err = _extract_one(capsys, tmp_path, model, str(target))
    assert code == 2 and "is a file; give a directory" in _one_line_error(
        err, "extract"
    )


def test_out_where_no_directory_can_be_made(tmp_path, capsys, model):
    # /proc takes no new directories, even for root (CI runs as root).
    code, err = _extract_one(capsys, tmp_path, model, "/proc/specshim-x/out")
    assert code == 2 and "cannot create the output directory" in _one_line_error(
        err, "extract"
    )


@pytest.mark.parametrize("command", ["extract", "verify"])
def test_corrupt_data_config_is_an_error_sentence(tmp_path, capsys, model, command):
    out = tmp_path / "o"
    out.mkdir()
    (out / "data_config.json").write_text("{oops")
    args = ["--model", model, "--out", str(out)]
    if command == "extract":
        args += ["--data", _data(tmp_path, [OK_LINE])]
    code = main([command, *args])
    err = capsys.readouterr().err
    assert code == 1 and "data_config.json is corrupt" in _one_line_error(err, command)


def test_summary_counts_in_words():
    from specshim.cli import summary

    one = {"written": 1, "skipped": 0, "tokens": 1, "seconds": 1.0}
    assert "wrote 1 sample (0 already there)" in summary(one, Path("o"))
    assert "1 token at" in summary(one, Path("o"))
    two = one | {"written": 2, "rewritten": {"why": 2}}
    assert "wrote 2 samples, 2 of them rewritten" in summary(two, Path("o"))
