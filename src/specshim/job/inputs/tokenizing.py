"""Records into samples: token ids and loss masks, checked and truncated.

Chat turns go through speculators 0.3.0's own preprocessing (conversation
normalisation, assistant-span detection from the chat template, loss mask from
character offsets), so the masks are the ones speculators' own pipeline makes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specshim._base import UsageError
from specshim.job.inputs.dataset import Record

logger = logging.getLogger(__name__)


@dataclass
class Sample:
    index: int  # position in the dataset: sample i is written to data_{i}.pt
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False  # cut to max_len tokens


class Tokenizing:
    """Turns records into token ids and loss masks, loading the tokenizer lazily."""

    def __init__(self, model: Path, trust_remote_code: bool = False) -> None:
        self.model = model
        self.trust_remote_code = trust_remote_code  # the user's consent, given
        self._tokenizer: Any = None
        self._pattern: str | None = None
        self.truncated = 0  # samples cut to max_len by sample()

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(
                str(self.model), trust_remote_code=self.trust_remote_code
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
