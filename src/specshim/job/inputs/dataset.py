"""Reading ``extract``'s input: token ids, text, or chat turns.

JSONL is read line by line here; JSON arrays, Parquet, Arrow and Hugging Face
``datasets`` directories (``save_to_disk``) through the ``datasets`` library.
Every problem is reported with its line (or row) number before the model loads.
Records are turned into token ids and loss masks in ``tokenizing``.
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
from specshim.job.outdir.store import record_digest

logger = logging.getLogger(__name__)

KINDS = ("input_ids", "text", "messages", "conversations")


# Files read through the ``datasets`` library, by suffix (a directory is a
# ``save_to_disk`` dataset).
TABLE_BUILDERS = {".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
# Compressed files, known by their first bytes (the name may say otherwise):
# each a module of the standard library that opens it (None where none can),
# and the suffix that names it.
COMPRESSIONS = {
    b"\x1f\x8b": ("gzip", "gzip", ".gz"),
    b"BZh": ("bzip2", "bz2", ".bz2"),
    b"\xfd7zXZ\x00": ("xz", "lzma", ".xz"),
    b"\x28\xb5\x2f\xfd": ("zstd", None, ".zst"),
}
_COMPRESSED_SUFFIXES = tuple(suffix for _, _, suffix in COMPRESSIONS.values())


def _compression(path: Path) -> tuple[str, str | None, str] | None:
    """What ``path``'s first bytes say it is compressed with, if anything."""
    with path.open("rb") as handle:
        head = handle.read(6)
    for magic, found in COMPRESSIONS.items():
        if head.startswith(magic):
            return found
    return None


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

    found = _compression(path)
    if found is None:
        return path.open("rb")
    name, module, _ = found
    if module is None:
        raise UsageError(
            f"--data {path}: compressed with {name}, which specshim "
            f"cannot read; decompress it first"
        )
    return importlib.import_module(module).open(path, "rb")


def _refuse_unnamed_compression(path: Path) -> None:
    """datasets decompresses a table file by its name's suffix, not its content."""
    if path.is_dir() or path.suffix.lower() in _COMPRESSED_SUFFIXES:
        return
    found = _compression(path)
    if found is not None:
        name, _, suffix = found
        raise UsageError(
            f"--data {path}: its content is {name}-compressed but its name "
            f"does not say so; name it {path.name}{suffix}"
        )


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
        if path.exists() and not (path.is_file() or path.is_dir()):
            # a FIFO or a device: reading it blocked until a writer came
            raise UsageError(
                f"--data {path}: not a regular file or a directory; give the "
                "dataset's file (or a datasets save_to_disk folder)"
            )
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
        _refuse_unnamed_compression(path)
        # datasets logs a reader's failure before raising it; the raise
        # becomes the one-line error.
        logging.getLogger("datasets").setLevel(logging.CRITICAL)
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
