"""What an export directory keeps about itself: the manifest of the files
it checked (``.specshim-export/manifest.jsonl``) and the marker written last
(``specshim_export.json``). A rerun trusts them only as an export writes them:
a damaged marker is refused (the files' settings are unknown), a damaged
manifest line is skipped (its file is written and checked again).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specshim._base import UsageError
from specshim.job.outdir.manifest import decode_json
from specshim.job.outdir.store import file_identity, final_path


def read_marker(marker: Path) -> dict[str, Any]:
    """An earlier export's ``specshim_export.json``; refused if damaged."""
    try:
        found = decode_json(marker.read_text(encoding="utf-8"))
        why = "" if isinstance(found, dict) else "not a JSON object"
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        found, why = None, str(exc)
    if why:
        raise UsageError(
            f"{marker} is damaged ({why}), so the settings of the export in "
            f"{marker.parent} are unknown; remove that directory, or export to "
            "another"
        )
    return found


def _is_identity(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 3
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )


def _is_agreement(value: Any, layers: int) -> bool:
    """None, or per layer [mean cosine, lowest cosine, mean norm ratio]."""
    if value is None:
        return True
    number = (int, float)
    return (
        isinstance(value, list)
        and len(value) == layers
        and all(
            isinstance(row, list)
            and len(row) == 3
            and all(isinstance(v, number) and not isinstance(v, bool) for v in row)
            for row in value
        )
    )


def _entry(line: str, layers: int) -> dict[str, Any] | None:
    """A manifest line as an export of ``layers`` layers writes it, or None."""
    try:
        entry = decode_json(line)
    except ValueError:
        return None  # a line torn by a killed run, or damaged
    if not isinstance(entry, dict) or not isinstance(entry.get("index"), int):
        return None
    if not (_is_identity(entry.get("source")) and _is_identity(entry.get("file"))):
        return None
    return entry if _is_agreement(entry.get("agreement"), layers) else None


class ExportManifest:
    """Per sample, as written: the source's and the file's identities, and
    (fp8) what a reader gets back against the source, per layer."""

    def __init__(self, path: Path, layers: int) -> None:
        self.entries: dict[int, dict[str, Any]] = {}
        if path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            for line in text.splitlines():
                entry = _entry(line, layers)
                if entry is not None:  # else its file is written again
                    self.entries[entry["index"]] = entry
        self.handle = path.open("a", encoding="utf-8")

    def holds(self, index: int, out: Path, dest: Path) -> bool:
        recorded = self.entries.get(index)
        target = dest / "hidden_states" / f"hs_{index}.safetensors"
        if recorded is None or not target.is_file():
            return False
        return recorded.get("source") == [
            *file_identity(final_path(out, index).stat())
        ] and recorded.get("file") == [*file_identity(target.stat())]

    def add(self, index: int, dest: Path, written: tuple[list[int], Any]) -> None:
        target = dest / "hidden_states" / f"hs_{index}.safetensors"
        source, agreement = written
        entry = {
            "index": index,
            "source": source,
            "file": [*file_identity(target.stat())],
            "agreement": agreement,
        }
        self.entries[index] = entry
        self.handle.write(json.dumps(entry) + "\n")
        self.handle.flush()

    def agreement(self, total: int) -> list[dict[str, float]] | None:
        """Over every sample: per layer, the mean and lowest cosine and the
        mean norm ratio (samples weigh alike); None where nothing was lossy."""
        rows = [self.entries[i].get("agreement") for i in range(total)]
        if not rows or any(r is None for r in rows):
            return None
        return [
            {
                "mean_cosine": round(sum(r[k][0] for r in rows) / len(rows), 5),
                "lowest_cosine": round(min(r[k][1] for r in rows), 5),
                "mean_norm_ratio": round(sum(r[k][2] for r in rows) / len(rows), 5),
            }
            for k in range(len(rows[0]))
        ]

    def close(self) -> None:
        self.handle.close()
