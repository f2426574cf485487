"""Shared by the ``test_cli_input_*`` modules: the tiny model, a data file,
one ``specshim extract`` call and the one-line error it should print."""

from __future__ import annotations

import json

import pytest

from specshim.cli import main


@pytest.fixture(name="model")
def model_fixture(tiny_model_dir):
    return str(tiny_model_dir("llama"))


def _data(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def _extract(capsys, *args):
    code = main(["extract", *args])
    return code, capsys.readouterr().err


OK_LINE = json.dumps({"input_ids": [1, 2, 3]})


def _extract_one(capsys, tmp_path, model, out, *extra):
    """``extract`` of one good sample into ``out``: what a flag alone breaks."""
    data = _data(tmp_path, [OK_LINE])
    return _extract(capsys, "--model", model, "--data", data, "--out", out, *extra)


def _one_line_error(err: str, command: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err  # one sentence, no traceback
    assert lines[0].startswith(f"specshim {command}: error: "), err
    return lines[0]
