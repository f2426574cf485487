"""Reading ``extract``'s input: token ids, text, or chat turns.

JSONL is read line by line here; JSON arrays, Parquet, Arrow and Hugging Face
``datasets`` directories (``save_to_disk``) through the ``datasets`` library.
Every problem is reported with its line (or row) number before the model loads.
Chat turns go through speculators 0.3.0's own preprocessing (conversation
normalisation, assistant-span detection from the chat template, loss mask from
character offsets), so the masks are the ones speculators' own pipeline makes.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specshim._base import UsageError
from specshim._settings import trust_remote_code
from specshim.job.store import record_digest

logger = logging.getLogger(__name__)

KINDS = ("input_ids", "text", "messages", "conversations")


@dataclass
class Sample:
    index: int  # position in the dataset: sample i is written to data_{i}.pt
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False  # cut to max_len tokens


# Files read through the ``datasets`` library, by suffix (a directory is a
# ``save_to_disk`` dataset).
TABLE_BUILDERS = {".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
# Compressed files, known by their first bytes (the name may say otherwise):
# each a module of the standard library that opens it, or None where none can.
COMPRESSIONS = {
    b"\x1f\x8b": ("gzip", "gzip"),
    b"BZh": ("bzip2", "bz2"),
    b"\xfd7zXZ\x00": ("xz", "lzma"),
    b"\x28\xb5\x2f\xfd": ("zstd", None),
}
_COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")


def _table_suffix(path: Path) -> str:
    """The suffix that says which table reader a file needs (``x.json.gz``:
    ``.json``; ``datasets`` decompresses by itself)."""
    suffixes = [s.lower() for s in path.suffixes]
    if len(suffixes) > 1 and suffixes[-1] in _COMPRESSED_SUFFIXES:
        return suffixes[-2]
    return path.suffix.lower()


def _open_lines(path: Path) -> Any:
    """``path`` opened for reading bytes, decompressed if its content is."""
    import importlib

    with path.open("rb") as handle:
        head = handle.read(6)
    for magic, (name, module) in COMPRESSIONS.items():
        if head.startswith(magic):
            if module is None:
                raise UsageError(
                    f"--data {path}: compressed with {name}, which specshim "
                    f"cannot read; decompress it first"
                )
            return importlib.import_module(module).open(path, "rb")
    return path.open("rb")


def parse_shard(
    text: str | None, environ: Mapping[str, str] = os.environ
) -> tuple[int, int]:
    """``"I/N"`` -> (I, N), with 0 <= I < N; ``"auto"`` asks the cluster."""
    if text is None:
        return 0, 1
    if text == "auto":
        return cluster_shard(environ)
    try:
        left, right = text.split("/")
        index, count = int(left), int(right)
    except ValueError:
        raise UsageError(
            f"--shard {text!r} is not of the form I/N (for example 0/4)"
        ) from None
    if count < 1 or not 0 <= index < count:
        raise UsageError(f"--shard {text!r}: need 0 <= I < N and N >= 1")
    return index, count


def cluster_shard(environ: Mapping[str, str]) -> tuple[int, int]:
    """This task's shard from a SLURM job array or a Kubernetes indexed Job.

    SLURM: ``SLURM_ARRAY_TASK_ID`` and ``SLURM_ARRAY_TASK_COUNT`` (or the
    array's ``_MIN``/``_MAX``; a step other than 1 is refused). Kubernetes:
    ``JOB_COMPLETION_INDEX`` and ``SPECSHIM_SHARD_COUNT`` (the Job's
    ``completions``, which Kubernetes does not export itself).
    """

    def number(name: str) -> int:
        try:
            return int(environ[name])
        except ValueError:
            raise UsageError(
                f"--shard auto: {name}={environ[name]!r} is not a number"
            ) from None

    if "SLURM_ARRAY_TASK_ID" in environ:
        task = number("SLURM_ARRAY_TASK_ID")
        if environ.get("SLURM_ARRAY_TASK_STEP", "1") != "1":
            raise UsageError(
                "--shard auto: the SLURM array has a step other than 1; use "
                "--array=0-N (or give --shard I/N)"
            )
        low = number("SLURM_ARRAY_TASK_MIN") if "SLURM_ARRAY_TASK_MIN" in environ else 0
        if "SLURM_ARRAY_TASK_COUNT" in environ:
            count = number("SLURM_ARRAY_TASK_COUNT")
        elif "SLURM_ARRAY_TASK_MAX" in environ:
            count = number("SLURM_ARRAY_TASK_MAX") - low + 1
        else:
            raise UsageError(
                "--shard auto: SLURM_ARRAY_TASK_ID is set but neither "
                "SLURM_ARRAY_TASK_COUNT nor SLURM_ARRAY_TASK_MAX"
            )
        return parse_shard(f"{task - low}/{count}")
    if "JOB_COMPLETION_INDEX" in environ:
        if "SPECSHIM_SHARD_COUNT" not in environ:
            raise UsageError(
                "--shard auto: JOB_COMPLETION_INDEX is set (a Kubernetes indexed "
                "Job); set SPECSHIM_SHARD_COUNT to the Job's completions too"
            )
        index, count = number("JOB_COMPLETION_INDEX"), number("SPECSHIM_SHARD_COUNT")
        return parse_shard(f"{index}/{count}")
    raise UsageError(
        "--shard auto: found no cluster task index (SLURM_ARRAY_TASK_ID of a job "
        "array, or JOB_COMPLETION_INDEX of a Kubernetes indexed Job); give --shard I/N"
    )


@dataclass
class Record:
    """One dataset line: where it is, what it says, and its fingerprint."""

    index: int  # position in the dataset: sample i is written to data_{i}.pt
    where: str  # "file:line" (JSONL) or "file: row n" (tables), for errors
    data: dict[str, Any]
    digest: str


def _normalise(value: Any, where: str, column: str | None) -> dict[str, Any]:
    """A record as one of KINDS; ``column`` names the field that holds the data."""
    if not isinstance(value, dict):
        raise UsageError(f"{where}: expected an object with one of " + ", ".join(KINDS))
    if column is None:
        record = {k: v for k, v in value.items() if v is not None}
        if not any(k in record for k in KINDS):
            raise UsageError(
                f"{where}: expected an object with one of "
                + ", ".join(KINDS)
                + " (or name the field with --column)"
            )
        return record
    if value.get(column) is None:
        raise UsageError(f"{where}: no {column!r} field (--column {column})")
    data = value[column]
    if isinstance(data, str):
        return {"text": data}
    if isinstance(data, list) and data and all(isinstance(t, dict) for t in data):
        return {"messages": data}
    return {"input_ids": data}


class RecordStream:
    """This shard's records, read lazily, in dataset order; malformed lines raise.

    Memory does not grow with the dataset: JSONL is read line by line, tables
    through ``datasets``' streaming readers (a ``save_to_disk`` directory is
    memory-mapped). Every record is parsed and checked, whichever shard it
    belongs to, so that all shards agree on what sample i is. ``total`` (the
    dataset's size) is known once the stream is exhausted, and from the start
    for a ``save_to_disk`` directory.
    """

    def __init__(
        self,
        path: Path,
        shard: tuple[int, int] = (0, 1),
        split: str | None = None,
        column: str | None = None,
    ) -> None:
        self.path, self.shard, self.split, self.column = path, shard, split, column
        self.total: int | None = None
        self.table = path.is_dir() or _table_suffix(path) in TABLE_BUILDERS
        if not self.table:
            if split is not None:
                raise UsageError(f"--split {split}: a JSONL file has no splits")
            if not path.is_file():
                raise UsageError(f"--data {path}: no such file")
        elif not path.exists():
            raise UsageError(f"--data {path}: no such file or directory")

    def __iter__(self) -> Iterator[Record]:
        rows = self._table_rows() if self.table else self._jsonl_rows()
        index, count = self.shard
        position = -1
        for position, where, value in rows:
            record = _normalise(value, where, self.column)
            if position % count == index:
                yield Record(position, where, record, _digest(record, where))
        if position < 0:
            what = "rows" if self.table else "JSON lines"
            raise UsageError(f"--data {self.path}: the dataset is empty (no {what})")
        self.total = position + 1

    def _jsonl_rows(self) -> Iterator[tuple[int, str, Any]]:
        path = self.path
        try:
            handle = _open_lines(path)
        except OSError as exc:
            raise UsageError(
                f"--data {path}: cannot read it ({exc.strerror})"
            ) from None
        position = 0
        with handle:
            for number, raw in enumerate(_decompressed(handle, path), start=1):
                if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise UsageError(
                        f"{path}:{number}: not UTF-8 text (byte {exc.start + 1} of "
                        "the line); convert the file to UTF-8"
                    ) from None
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UsageError(
                        f"{path}:{number}: not valid JSON ({exc.msg})"
                    ) from None
                except RecursionError:
                    raise UsageError(
                        f"{path}:{number}: JSON nested too deeply to read"
                    ) from None
                except ValueError as exc:  # e.g. a number of 5,000 digits
                    where = f"{path}:{number}"
                    raise UsageError(f"{where}: unusable JSON ({exc})") from None
                yield position, f"{path}:{number}", value
                position += 1

    def _table_rows(self) -> Iterator[tuple[int, str, Any]]:
        """A ``datasets``-readable file or ``save_to_disk`` directory, row by row."""
        import datasets

        path, split = self.path, self.split
        try:
            if path.is_dir():
                table = datasets.load_from_disk(str(path))
            else:
                builder = TABLE_BUILDERS[_table_suffix(path)]
                table = datasets.load_dataset(
                    builder, data_files=str(path), streaming=True
                )
        except Exception as exc:  # noqa: BLE001 - the library's many error types
            raise _unreadable(path, exc) from None
        if isinstance(table, (datasets.DatasetDict, datasets.IterableDatasetDict)):
            name = split or "train"
            if name not in table:
                raise UsageError(
                    f"--data {path} has no split {name!r}; its splits: "
                    + ", ".join(table)
                    + " (choose one with --split)"
                )
            table = table[name]
        elif split is not None:
            raise UsageError(f"--split {split}: {path} holds a single split")
        if isinstance(table, datasets.Dataset):
            self.total = len(table)
        rows = iter(table)
        position = 0
        while True:
            try:
                row = next(rows)
            except StopIteration:
                return
            except Exception as exc:  # noqa: BLE001 - a corrupt file mid-way
                raise _unreadable(path, exc, f" at row {position + 1}") from None
            yield position, f"{path}: row {position + 1}", row
            position += 1


def _digest(record: dict[str, Any], where: str) -> str:
    """``record_digest``, or a one-line error for data JSON cannot carry: text
    that is not valid Unicode (a lone surrogate escape such as "\\ud800"), a
    value of a type JSON has not (a table's bytes or timestamps), nesting too
    deep to write."""
    try:
        return record_digest(record)
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start : exc.end].encode("unicode_escape").decode()
        raise UsageError(
            f"{where}: text that is not valid Unicode ({bad}, a lone surrogate)"
        ) from None
    except TypeError as exc:
        raise UsageError(
            f"{where}: a field JSON cannot hold ({exc}); drop that column or pass "
            "--column with the field that holds the sample"
        ) from None
    except (RecursionError, ValueError) as exc:
        raise UsageError(f"{where}: a field nested too deeply ({exc})") from None


def _decompressed(handle: Any, path: Path) -> Iterator[bytes]:
    """The lines of ``handle``; damaged compressed data is a one-line error."""
    import lzma
    import zlib

    number = 0
    while True:
        try:
            raw = handle.readline()
        except (EOFError, OSError, zlib.error, lzma.LZMAError) as exc:
            raise UsageError(
                f"{path}:{number + 1}: the compressed data is damaged or cut "
                f"short ({exc})"
            ) from None
        if not raw:
            return
        number += 1
        yield raw


def _unreadable(path: Path, exc: Exception, where: str = "") -> UsageError:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
    return UsageError(f"--data {path}: cannot read it as a dataset{where} ({first})")


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


class Tokenizing:
    """Turns records into token ids and loss masks, loading the tokenizer lazily."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self._tokenizer: Any = None
        self._pattern: str | None = None
        self.truncated = 0  # samples cut to max_len by sample()

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(
                str(self.model), trust_remote_code=trust_remote_code()
            )
        return self._tokenizer

    def encode(self, where: str, record: dict[str, Any]) -> tuple[list[int], list[int]]:
        if "input_ids" in record:
            ids = record["input_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise UsageError(f"{where}: input_ids must be a list of integers")
            return ids, [1] * len(ids)
        if "text" in record:
            if not isinstance(record["text"], str):
                raise UsageError(f"{where}: text must be a string")
            ids = self.tokenizer(record["text"], add_special_tokens=True)["input_ids"]
            return list(ids), [1] * len(ids)
        turns = record.get("messages", record.get("conversations"))
        return self._encode_chat(where, turns)

    def sample(self, record: Record, vocab_size: int, max_len: int) -> Sample:
        """``record`` as a checked sample, truncated to ``max_len`` tokens."""
        where = record.where
        ids, mask = self.encode(where, record.data)
        if not ids:
            raise UsageError(f"{where}: the sample has no tokens")
        bad = [t for t in ids if t < 0 or t >= vocab_size]
        if bad:
            raise UsageError(
                f"{where}: token id {bad[0]} is outside the model's vocabulary "
                f"[0, {vocab_size}) ({len(bad)} such ids in this sample)"
            )
        if len(ids) > max_len:
            self.truncated += 1
            return Sample(record.index, ids[:max_len], mask[:max_len], True)
        return Sample(record.index, ids, mask)

    def _encode_chat(self, where: str, turns: Any) -> tuple[list[int], list[int]]:
        from speculators.data_generation import preprocessing

        if not isinstance(turns, list) or not turns:
            raise UsageError(f"{where}: messages must be a non-empty list of turns")
        odd = next((t for t in turns if not isinstance(t, dict)), None)
        if odd is not None:
            raise UsageError(
                f"{where}: each chat turn must be an object such as "
                f'{{"role": "user", "content": "..."}}, found {type(odd).__name__} '
                f"{str(odd)[:40]!r}"
            )
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise UsageError(
                f"{where}: chat turns need a tokenizer with a chat template; "
                f"{self.model} has none (use text or input_ids)"
            )
        if self._pattern is None:
            self._pattern = preprocessing._detect_assistant_pattern(self.tokenizer)
        out = preprocessing._preprocess_batch(
            {"conversations": [turns]}, self.tokenizer, 1 << 30, self._pattern
        )
        if not out["input_ids"]:
            raise UsageError(
                f"{where}: speculators' preprocessing could not render this "
                "conversation (unknown roles only, or a chat template error)"
            )
        return out["input_ids"][0].tolist(), out["loss_mask"][0].tolist()


def tokenize(
    path: Path, model: Path, records: list[Record], vocab_size: int, max_len: int
) -> list[Sample]:
    """``records`` as samples: checked, and truncated to ``max_len`` tokens."""
    tokenizing = Tokenizing(model)
    samples = [tokenizing.sample(r, vocab_size, max_len) for r in records]
    warn_truncated(tokenizing.truncated, len(samples), max_len)
    return samples


def warn_truncated(truncated: int, count: int, max_len: int) -> None:
    if truncated:
        logger.warning(
            "%d of %d samples are longer than max_model_len - 1 = %d tokens and were "
            "truncated to it (as speculators does); raise --max-model-len to keep "
            "them whole",
            truncated,
            count,
            max_len,
        )


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
