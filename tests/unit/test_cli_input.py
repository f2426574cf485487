"""``specshim extract`` refuses bad input clearly, before loading a model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from specshim import _dataset
from specshim.cli import main


@pytest.fixture
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


def _data(tmp_path, lines):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def _extract(capsys, *args):
    code = main(["extract", *args])
    return code, capsys.readouterr().err


OK_LINE = json.dumps({"input_ids": [1, 2, 3]})


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
    assert not list(out.glob("*.pt")) if out.exists() else True


def test_missing_model_directory(tmp_path, capsys):
    code, err = _extract(
        capsys,
        "--model",
        str(tmp_path / "nope"),
        "--data",
        _data(tmp_path, [OK_LINE]),
        "--out",
        str(tmp_path / "o"),
    )
    assert code == 2 and "no such directory" in err


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


def test_over_length_samples_are_truncated_with_a_count(tmp_path, model, caplog):
    lines = [json.dumps({"input_ids": [1] * n}) for n in (10, 40, 50)]
    with caplog.at_level(logging.WARNING):
        samples, total = _dataset.load_samples(
            Path(_data(tmp_path, lines)), Path(model), 320, 31, (0, 1)
        )
    assert total == 3 and [len(s.input_ids) for s in samples] == [10, 31, 31]
    assert "2 of 3 samples are longer than max_model_len - 1 = 31" in caplog.text


def test_shards_partition_the_dataset(tmp_path, model):
    lines = [json.dumps({"input_ids": [i + 1]}) for i in range(7)]
    data = Path(_data(tmp_path, lines))
    seen = []
    for index in range(3):
        samples, _ = _dataset.load_samples(data, Path(model), 320, 100, (index, 3))
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
    (sample,), _ = _dataset.load_samples(
        Path(_data(tmp_path, [line])), Path(model), 320, 100, (0, 1)
    )
    assert sum(sample.loss_mask) == 3  # "yo!": one byte token each, assistant only
    text = json.dumps({"text": "abc"})
    (sample,), _ = _dataset.load_samples(
        Path(_data(tmp_path, [text])), Path(model), 320, 100, (0, 1)
    )
    assert sample.loss_mask == [1] * len(sample.input_ids)


def test_every_command_has_help_with_an_example(capsys):
    for command in ("extract", "verify", "demo", "run", "doctor", "table"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "example:" in capsys.readouterr().out
