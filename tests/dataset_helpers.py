"""Whole-dataset helpers for tests (the job streams; tests of small datasets
read them at once)."""

from __future__ import annotations

from pathlib import Path

from specshim.job.inputs.dataset import Record, RecordStream
from specshim.job.inputs.tokenizing import Sample, Tokenizing, warn_truncated


def read_records(
    path: Path,
    shard: tuple[int, int] = (0, 1),
    split: str | None = None,
    column: str | None = None,
) -> tuple[list[Record], int]:
    """This shard's records as a list, and the dataset's size (small datasets)."""
    stream = RecordStream(path, shard, split, column)
    records = list(stream)
    assert stream.total is not None
    return records, stream.total


def tokenize(
    path: Path, model: Path, records: list[Record], vocab_size: int, max_len: int
) -> list[Sample]:
    """``records`` as samples: checked, and truncated to ``max_len`` tokens."""
    tokenizing = Tokenizing(model)
    samples = [tokenizing.sample(r, vocab_size, max_len) for r in records]
    warn_truncated(tokenizing.truncated, len(samples), max_len)
    return samples


def load_samples(
    path: Path,
    model: Path,
    vocab_size: int,
    max_len: int,
    shard: tuple[int, int],
) -> tuple[list[Sample], int]:
    """This shard's samples, checked and truncated; and the dataset's size."""
    records, total = read_records(path, shard)
    return tokenize(path, model, records, vocab_size, max_len), total
