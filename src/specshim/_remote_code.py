"""Which Python code a checkpoint ships, and whether the user consented to it.

transformers and vLLM run a checkpoint's own Python files (named by an
``auto_map`` in its JSON configs) only with ``trust_remote_code=True``.
speculators 0.3.0 passes ``True`` in every loader it calls, so any checkpoint
directory could run code in the main process and in every vLLM worker without
anyone being asked. specshim asks: consent comes from
``specshim.configure(trust_remote_code=True)``, ``SPECSHIM_TRUST_REMOTE_CODE=1``
or the command line's ``--trust-remote-code``; without it a checkpoint that
carries code is refused before anything is loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

from specshim._base import SpecShimError, UsageError
from specshim._settings import TRUST_ENV, trust_remote_code

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# The JSON files transformers reads an auto_map from.
CONFIG_FILES = (
    "config.json",
    "tokenizer_config.json",
    "processor_config.json",
    "preprocessor_config.json",
    "generation_config.json",
)


def _references(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, str)]
    if isinstance(value, dict):
        return [r for v in value.values() for r in _references(v)]
    return []


def code_files(model: Path) -> list[str]:
    """The code a local checkpoint would run: ``file.py (from config.json)``.

    A reference into another repository (``repo--module.Class``) is named as
    it stands. A config that cannot be parsed counts as carrying code: what it
    would make transformers do cannot be proven.
    """
    found: dict[str, str] = {}
    for name in CONFIG_FILES:
        path = model / name
        if not path.is_file():
            continue
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            found.setdefault(f"{name} (unreadable)", name)
            continue
        if not isinstance(config, dict):
            continue
        for reference in _references(config.get("auto_map")):
            module = reference.rsplit(".", 1)[0]
            label = module if "--" in module else f"{module}.py"
            found.setdefault(label, name)
    return [f"{label} (from {source})" for label, source in sorted(found.items())]


def refusal(model: str, files: list[str], flag: bool) -> str:
    how = (
        "pass --trust-remote-code"
        if flag
        else f"call specshim.configure(trust_remote_code=True) or set {TRUST_ENV}=1"
    )
    return (
        f"{model} ships Python code that would run in this process and in every "
        f"vLLM worker: {', '.join(files)}. Read it, and if you trust it, {how}."
    )


def require_consent(model: str | Path, *, flag: bool = False) -> bool:
    """Refuse a local checkpoint that carries code unless the user consented.

    Returns the consent. ``flag`` words the error for the command line (a usage
    error, ``--trust-remote-code``) rather than for the library.
    """
    consent = trust_remote_code()
    path = Path(model)
    if consent or not path.is_dir():
        return consent
    files = code_files(path)
    if files:
        error = UsageError if flag else SpecShimError
        raise error(refusal(str(model), files, flag))
    return consent
