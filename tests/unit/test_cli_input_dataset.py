"""``specshim extract`` on bad or unusual ``--data``: one-line refusals before
the model loads, truncation, shards and loss masks."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from .. import dataset_helpers
from ._cli_input_helpers import (
    OK_LINE,
    _data,
    _extract,
    _one_line_error,
    model_fixture,  # noqa: F401 - the model fixture
)


@pytest.mark.parametrize(
    ("lines", "extra", "message"),
    [
        ([OK_LINE, "{not json"], [], "data.jsonl:2: not valid JSON"),
        (
            [OK_LINE, json.dumps({"prompt": "x"})],
            [],
            "data.jsonl:2: expected an object",
        ),
        (
            [OK_LINE, json.dumps({"input_ids": [1, 320]})],
            [],
            "data.jsonl:2: token id 320 is outside",
        ),
        ([json.dumps({"input_ids": [-4]})], [], "token id -4"),
        ([json.dumps({"input_ids": [1, "a"]})], [], "list of integers"),
        ([json.dumps({"input_ids": []})], [], "no tokens"),
        (["", "  "], [], "the dataset is empty"),
        ([OK_LINE], ["--layers", "1,6"], "--layers [6] out of range: the model has 6"),
        ([OK_LINE], ["--layers", "3,1"], "increasing order"),
        ([OK_LINE], ["--layers", "a"], "comma-separated integers"),
        ([OK_LINE], ["--shard", "2/2"], "need 0 <= I < N"),
        ([OK_LINE], ["--shard", "one"], "not of the form I/N"),
        # Data that parses but cannot be used.
        (
            [OK_LINE, '{"text": "a \\ud800 b"}'],
            [],
            "data.jsonl:2: text that is not valid",
        ),
        (
            [OK_LINE, json.dumps({"messages": ["hi", "there"]})],
            [],
            "data.jsonl:2: each chat turn must be an object",
        ),
        (
            [OK_LINE, '{"input_ids": [1], "x": ' + "[" * 100000 + "]" * 100000 + "}"],
            [],
            "data.jsonl:2: JSON nested too deeply",
        ),
        (
            [OK_LINE, '{"input_ids": [' + "9" * 5000 + "]}"],
            [],
            "data.jsonl:2: unusable",
        ),
    ],
)
def test_bad_input_is_refused_before_model_load(
    tmp_path, capsys, model, lines, extra, message
):
    out = tmp_path / "out"
    code, err = _extract(
        capsys,
        "--model",
        model,
        "--data",
        _data(tmp_path, lines),
        "--out",
        str(out),
        *extra,
    )
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1, err  # one line, no traceback
    assert not list(out.glob("*.pt")) if out.exists() else True


def test_a_table_column_json_cannot_hold_is_one_line(tmp_path, capsys, model):
    import datasets

    path = tmp_path / "d.parquet"
    datasets.Dataset.from_list([{"input_ids": [1, 2], "blob": b"\x00\x01"}]).to_parquet(
        str(path)
    )
    capsys.readouterr()  # datasets' own progress bar
    code, err = _extract(
        capsys, "--model", model, "--data", str(path), "--out", str(tmp_path / "o")
    )
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "d.parquet: row 1: a field JSON cannot hold" in err


def test_missing_data_file(tmp_path, capsys, model):
    code, err = _extract(
        capsys,
        "--model",
        model,
        "--data",
        str(tmp_path / "x.jsonl"),
        "--out",
        str(tmp_path / "o"),
    )
    assert code == 2 and "no such file" in err


@pytest.mark.timeout(120)  # before the fix: it waited for a writer forever
@pytest.mark.parametrize("name", ["d.jsonl", "d.parquet"])
def test_data_that_is_no_regular_file_is_refused_at_once(tmp_path, capsys, model, name):
    import os

    fifo = tmp_path / name
    os.mkfifo(fifo)
    code, err = _extract(
        capsys, "--model", model, "--data", str(fifo), "--out", str(tmp_path / "o")
    )
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--data {fifo}: not a regular file or a directory" in err


def test_over_length_samples_are_truncated_with_a_count(tmp_path, model, caplog):
    lines = [json.dumps({"input_ids": [1] * n}) for n in (10, 40, 50)]
    with caplog.at_level(logging.WARNING):
        samples, total = dataset_helpers.load_samples(
            Path(_data(tmp_path, lines)), Path(model), 320, 31, (0, 1)
        )
    assert total == 3 and [len(s.input_ids) for s in samples] == [10, 31, 31]
    assert "2 of 3 samples are longer than max_model_len - 1 = 31" in caplog.text


def test_shards_partition_the_dataset(tmp_path, model):
    lines = [json.dumps({"input_ids": [i + 1]}) for i in range(7)]
    data = Path(_data(tmp_path, lines))
    seen = []
    for index in range(3):
        samples, _ = dataset_helpers.load_samples(
            data, Path(model), 320, 100, (index, 3)
        )
        seen += [s.index for s in samples]
        assert all(s.index % 3 == index for s in samples)
    assert sorted(seen) == list(range(7))


def test_chat_lines_use_speculators_loss_mask(tmp_path, model):
    line = json.dumps(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo!"},
            ]
        }
    )
    (sample,), _ = dataset_helpers.load_samples(
        Path(_data(tmp_path, [line])), Path(model), 320, 100, (0, 1)
    )
    assert sum(sample.loss_mask) == 3  # "yo!": one byte token each, assistant only
    text = json.dumps({"text": "abc"})
    (sample,), _ = dataset_helpers.load_samples(
        Path(_data(tmp_path, [text])), Path(model), 320, 100, (0, 1)
    )
    assert sample.loss_mask == [1] * len(sample.input_ids)


def test_non_utf8_data_names_the_line(tmp_path, capsys, model):
    data = tmp_path / "d.jsonl"
    data.write_bytes(OK_LINE.encode() + b"\n" + b'{"text": "\xff\xfe"}\n')
    code, err = _extract(
        capsys, "--model", model, "--data", str(data), "--out", str(tmp_path / "o")
    )
    assert code == 2 and "d.jsonl:2: not UTF-8 text" in _one_line_error(err, "extract")


def test_utf8_byte_order_mark_is_accepted(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_bytes(b"\xef\xbb\xbf" + OK_LINE.encode() + b"\n")
    records, total = dataset_helpers.read_records(data)
    assert total == 1 and records[0].data == {"input_ids": [1, 2, 3]}
