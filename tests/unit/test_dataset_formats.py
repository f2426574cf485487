"""Every input format gives the same samples; cluster shards from the environment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specshim._base import UsageError
from specshim.job.inputs.dataset import parse_shard

from ..dataset_helpers import read_records, tokenize

ROWS = [
    {"input_ids": [5, 6, 7]},
    {"text": "hello there"},
    {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo!"},
        ]
    },
    {"input_ids": [9]},
]
# The same chat, ShareGPT-style.
SHAREGPT = {
    "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo!"}]
}


def _samples(path: Path, model: Path, **kwargs):
    records, total = read_records(path, **kwargs)
    return total, [
        (s.index, s.input_ids, s.loss_mask)
        for s in tokenize(path, model, records, 320, 100)
    ]


def _table(rows):
    import datasets

    # One schema for every row: absent fields are None (dropped when read).
    keys = sorted({k for row in rows for k in row})
    return datasets.Dataset.from_list([{k: row.get(k) for k in keys} for row in rows])


@pytest.fixture
def model(tiny_model_dir):
    return tiny_model_dir("llama")


def test_every_format_gives_the_jsonl_samples(tmp_path, model):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    expected = _samples(jsonl, model)
    array = tmp_path / "d.json"
    array.write_text(json.dumps(ROWS))
    table = _table(ROWS)
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    (arrow,) = (tmp_path / "saved").glob("*.arrow")
    for path in (array, tmp_path / "d.parquet", tmp_path / "saved", arrow):
        assert _samples(path, model) == expected, path


def test_sharegpt_conversations_equal_messages(tmp_path, model):
    table = _table([SHAREGPT])
    table.to_parquet(str(tmp_path / "c.parquet"))
    messages = tmp_path / "m.jsonl"
    messages.write_text(json.dumps(ROWS[2]) + "\n")
    (got,) = _samples(tmp_path / "c.parquet", model)[1]
    (want,) = _samples(messages, model)[1]
    assert got[1:] == want[1:] and sum(got[2]) == 3  # the assistant's "yo!"


def test_column_and_split_choose_the_data(tmp_path, model):
    import datasets

    rows = [{"chat": ROWS[2]["messages"]}, {"chat": SHAREGPT["conversations"]}]
    splits = datasets.DatasetDict(train=_table(rows), test=_table(rows[:1]))
    splits.save_to_disk(str(tmp_path / "dd"))
    total, samples = _samples(tmp_path / "dd", model, split="test", column="chat")
    assert total == 1 and samples[0][2].count(1) == 3
    with pytest.raises(UsageError, match="no split 'dev'; its splits: train, test"):
        read_records(tmp_path / "dd", split="dev", column="chat")
    with pytest.raises(UsageError, match=r"row 1: expected an object .* --column"):
        read_records(tmp_path / "dd")


def test_shards_of_a_table_partition_it(tmp_path):
    _table([{"input_ids": [i + 1]} for i in range(7)]).to_parquet(
        str(tmp_path / "t.parquet")
    )
    seen = []
    for index in range(3):
        records, total = read_records(tmp_path / "t.parquet", (index, 3))
        assert total == 7 and all(r.index % 3 == index for r in records)
        seen += [(r.index, r.data["input_ids"][0]) for r in records]
    assert sorted(seen) == [(i, i + 1) for i in range(7)]


@pytest.mark.parametrize(
    ("environ", "shard"),
    [
        ({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "8"}, (3, 8)),
        (
            {
                "SLURM_ARRAY_TASK_ID": "5",
                "SLURM_ARRAY_TASK_MIN": "4",
                "SLURM_ARRAY_TASK_MAX": "7",
            },
            (1, 4),
        ),
        ({"JOB_COMPLETION_INDEX": "2", "SPECSHIM_SHARD_COUNT": "4"}, (2, 4)),
    ],
)
def test_shard_auto_reads_slurm_and_kubernetes(environ, shard):
    assert parse_shard("auto", environ) == shard


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({}, "found no cluster task index"),
        ({"JOB_COMPLETION_INDEX": "2"}, "set SPECSHIM_SHARD_COUNT"),
        ({"SLURM_ARRAY_TASK_ID": "1"}, "neither SLURM_ARRAY_TASK_COUNT"),
        ({"SLURM_ARRAY_TASK_ID": "x", "SLURM_ARRAY_TASK_COUNT": "2"}, "not a number"),
        (
            {
                "SLURM_ARRAY_TASK_ID": "2",
                "SLURM_ARRAY_TASK_COUNT": "2",
                "SLURM_ARRAY_TASK_STEP": "2",
            },
            "step other than 1",
        ),
        ({"JOB_COMPLETION_INDEX": "4", "SPECSHIM_SHARD_COUNT": "4"}, "need 0 <= I < N"),
    ],
)
def test_shard_auto_refuses_what_it_cannot_read(environ, message):
    with pytest.raises(UsageError, match=message):
        parse_shard("auto", environ)


@pytest.mark.parametrize(
    ("name", "module"),
    [("d.jsonl.gz", "gzip"), ("d.jsonl.xz", "lzma"), ("d.jsonl.bz2", "bz2")],
)
def test_compressed_jsonl_streams_to_the_same_records(tmp_path, name, module):
    import importlib

    text = "".join(json.dumps(row) + "\n" for row in ROWS)
    plain = tmp_path / "d.jsonl"
    plain.write_text(text)
    packed = tmp_path / name
    with importlib.import_module(module).open(packed, "wt") as handle:
        handle.write(text)
    expected = [(r.index, r.data, r.digest) for r in read_records(plain)[0]]
    got, total = read_records(packed)
    assert [(r.index, r.data, r.digest) for r in got] == expected
    assert total == len(ROWS) and got[2].where == f"{packed}:3"


def test_a_gzipped_json_array_reads_as_the_plain_one(tmp_path):
    import gzip

    packed = tmp_path / "d.json.gz"
    with gzip.open(packed, "wt") as handle:
        json.dump(ROWS, handle)
    got, total = read_records(packed)
    assert total == len(ROWS) and [r.data for r in got] == ROWS


def test_damaged_or_unreadable_compression_is_one_line(tmp_path):
    import gzip

    cut = tmp_path / "cut.jsonl.gz"
    lines = b"".join(
        b'{"input_ids": [%d]}\n' % (i * 7919 % 100003) for i in range(9000)
    )
    packed = gzip.compress(lines)
    cut.write_bytes(packed[: len(packed) // 2])
    with pytest.raises(UsageError, match=r"cut\.jsonl\.gz:\d+: the compressed data"):
        read_records(cut)
    zstd = tmp_path / "d.jsonl.zst"
    zstd.write_bytes(b"\x28\xb5\x2f\xfd" + b"\x00" * 16)
    with pytest.raises(UsageError, match="compressed with zstd.*decompress it first"):
        read_records(zstd)


def test_a_compressed_table_file_its_name_hides_is_one_line(tmp_path, capfd):
    """datasets picks decompression by the name: a gzipped array named .json
    failed as a parse error, after datasets' own ERROR log line."""
    import gzip

    hidden = tmp_path / "d.json"
    hidden.write_bytes(gzip.compress(json.dumps(ROWS).encode()))
    with pytest.raises(UsageError, match=r"gzip-compressed .* name it d\.json\.gz$"):
        read_records(hidden)
    broken = tmp_path / "b.json"
    broken.write_text('[{"input_ids": [1]}, oops')
    with pytest.raises(UsageError, match="cannot read it as a dataset"):
        read_records(broken)
    captured = capfd.readouterr()
    assert "Failed to load JSON" not in captured.err + captured.out
