"""The runs' manifests, read back: one header and one ``Entry`` per file.

``Run`` (``specshim.job.outdir.store``) appends to its own manifest; everything that
reads them (``status``, a resumed ``extract``, ``export``) goes through
``read_manifest``, which trusts a line only as a run writes it. A line of
other shape or types (an edit, a stray tool, a failing disk) is skipped with
a warning, so the file it describes counts as not proven: a rerun rewrites it
instead of crashing on it or vouching for it.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_HEX = re.compile(r"^(?:[0-9a-f]{2})+$")  # a digest as token_digest writes it


@dataclass(frozen=True)
class Entry:
    """What a run recorded about one file it wrote."""

    index: int
    tokens: str  # token_digest of the sample
    record: str  # record_digest of the dataset record it came from
    size: int
    inode: int
    mtime_ns: int
    num_tokens: int
    # Cut to max_model_len - 1 tokens; None in manifests written before this
    # was recorded (7 fields), where ``was_truncated`` infers it.
    truncated: bool | None = None

    def was_truncated(self, max_len: int) -> bool:
        """Whether the sample was cut (older entries: it holds max_len tokens)."""
        if self.truncated is None:
            return self.num_tokens >= max_len
        return self.truncated

    def file_identity(self) -> tuple[int, int, int]:
        return (self.size, self.inode, self.mtime_ns)


def decode_json(text: str) -> Any:
    """``json.loads`` for text specshim may not have written: every way damaged
    text fails is a ValueError with a short reason. (Besides JSONDecodeError,
    the decoder raises a plain ValueError on a number of over 4,300 digits and
    RecursionError on deep nesting.)"""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{exc.msg} at line {exc.lineno}") from None
    except RecursionError:
        raise ValueError("nested too deeply") from None
    except ValueError as exc:
        raise ValueError(str(exc).split(";")[0]) from None


def read_manifest(path: Path) -> tuple[dict[str, Any], list[Entry]]:
    """One run's manifest: its header and its entries.

    A torn last line (a run killed mid-write) is skipped, and so is a line
    with a NUL byte (a live run's zero-filled room, or a crash's tear in it:
    ``manifest_room``). So is any other line
    that is not as a run writes it, with a warning: what it says is not
    trusted, so a file it describes counts as not proven.
    """
    header: dict[str, Any] = {"run": path.stem}
    entries, damaged = [], []
    with path.open(encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if "\0" in line:
                # The room's zeros (``manifest_room``): where a live run's
                # lines end, or one a crash tore before it was made durable
                # (so no file was renamed on its word).
                continue
            fields, why = parse_line(line)
            if isinstance(fields, dict):
                header.update(fields)
            elif isinstance(fields, Entry):
                entries.append(fields)
            elif line.endswith("\n"):  # else torn: nothing to say
                damaged.append((number, why))
    if damaged:
        logger.warning(
            "%s: skipped %d damaged line(s) (line %d: %s); what they record is "
            "not trusted, so files they describe count as not proven and a rerun "
            "of extract rewrites them",
            path,
            len(damaged),
            *damaged[0],
        )
    return header, entries


def parse_line(line: str) -> tuple[dict[str, Any] | Entry | None, str]:
    """A manifest line as a header part or an Entry; else None and why not."""
    try:
        fields = decode_json(line)
    except ValueError as exc:
        return None, f"not JSON: {exc}"
    if isinstance(fields, dict):
        for key, ok in _HEADER_CHECKS.items():
            if fields.get(key) is not None and not ok(fields[key]):
                return None, f"{key} is {fields[key]!r:.40}"
        return fields, ""
    if not isinstance(fields, list) or len(fields) not in (7, 8):
        return None, "not a header or an entry of 7 or 8 fields"
    index, tokens, record, *numbers = fields[:7]
    truncated = fields[7] if len(fields) == 8 else None
    if not all(_is_count(n) for n in (index, *numbers)):
        return None, "an index, size, inode, time or token count is no count"
    if not all(isinstance(d, str) and _HEX.match(d) for d in (tokens, record)):
        return None, "a digest is not hexadecimal"
    if truncated is not None and not isinstance(truncated, bool):
        return None, f"truncated is {truncated!r:.40}"
    return Entry(*fields), ""


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_time(value: Any) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value)


def _is_shard(value: Any) -> bool:
    if not isinstance(value, list) or len(value) != 2:
        return False
    index, count = value
    return _is_count(index) and _is_count(count) and index < count


# What a header line may hold, as ``Run`` and ``extract`` write it.
_HEADER_CHECKS = {
    "run": lambda value: isinstance(value, str),
    "started": _is_time,
    "finished": _is_time,
    "shard": _is_shard,
    "dataset_samples": _is_count,
}
