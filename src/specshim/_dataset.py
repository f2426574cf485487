"""Reading ``extract``'s JSONL input: token ids, text, or chat turns.

Every problem is reported with its line number before the model loads.
Chat turns go through speculators 0.3.0's own preprocessing (conversation
normalisation, assistant-span detection from the chat template, loss mask from
character offsets), so the masks are the ones speculators' own pipeline makes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specshim._errors import UsageError
from specshim._settings import trust_remote_code
from specshim._store import record_digest

logger = logging.getLogger(__name__)

KINDS = ("input_ids", "text", "messages", "conversations")


@dataclass
class Sample:
    index: int  # position in the dataset: sample i is written to data_{i}.pt
    input_ids: list[int]
    loss_mask: list[int]


def parse_shard(text: str | None) -> tuple[int, int]:
    """``"I/N"`` -> (I, N), with 0 <= I < N."""
    if text is None:
        return 0, 1
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


@dataclass
class Record:
    """One dataset line: where it is, what it says, and its fingerprint."""

    index: int  # position in the dataset: sample i is written to data_{i}.pt
    number: int  # line number in the file
    data: dict[str, Any]
    digest: str


def read_records(
    path: Path, shard: tuple[int, int] = (0, 1)
) -> tuple[list[Record], int]:
    """This shard's records and the dataset's size; malformed lines raise.

    Every line is checked, whichever shard it belongs to, so that all shards
    agree on what sample i is. A UTF-8 byte-order mark is accepted.
    """
    if not path.is_file():
        raise UsageError(f"--data {path}: no such file")
    shard_index, shard_count = shard
    records = []
    position = 0
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise UsageError(f"--data {path}: cannot read it ({exc.strerror})") from None
    with handle:
        for number, raw in enumerate(handle, start=1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UsageError(
                    f"{path}:{number}: not UTF-8 text (byte {exc.start + 1} of the "
                    "line); convert the file to UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(
                    f"{path}:{number}: not valid JSON ({exc.msg})"
                ) from None
            if not isinstance(record, dict) or not any(k in record for k in KINDS):
                raise UsageError(
                    f"{path}:{number}: expected an object with one of "
                    + ", ".join(KINDS)
                )
            if position % shard_count == shard_index:
                records.append(Record(position, number, record, record_digest(record)))
            position += 1
    if not position:
        raise UsageError(f"--data {path}: the dataset is empty (no JSON lines)")
    return records, position


class Tokenizing:
    """Turns records into token ids and loss masks, loading the tokenizer lazily."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self._tokenizer: Any = None
        self._pattern: str | None = None

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

    def _encode_chat(self, where: str, turns: Any) -> tuple[list[int], list[int]]:
        from speculators.data_generation import preprocessing

        if not isinstance(turns, list) or not turns:
            raise UsageError(f"{where}: messages must be a non-empty list of turns")
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
    samples = []
    truncated = 0
    for record in records:
        where = f"{path}:{record.number}"
        ids, mask = tokenizing.encode(where, record.data)
        if not ids:
            raise UsageError(f"{where}: the sample has no tokens")
        bad = [t for t in ids if t < 0 or t >= vocab_size]
        if bad:
            raise UsageError(
                f"{where}: token id {bad[0]} is outside the model's vocabulary "
                f"[0, {vocab_size}) ({len(bad)} such ids in this sample)"
            )
        if len(ids) > max_len:
            truncated += 1
            ids, mask = ids[:max_len], mask[:max_len]
        samples.append(Sample(record.index, ids, mask))
    if truncated:
        logger.warning(
            "%d of %d samples are longer than max_model_len - 1 = %d tokens and were "
            "truncated to it (as speculators does); raise --max-model-len to keep "
            "them whole",
            truncated,
            len(samples),
            max_len,
        )
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
