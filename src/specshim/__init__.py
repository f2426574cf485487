"""specshim: run speculators 0.3.0's hidden-state generator on newer vLLM.

``import specshim`` before speculators arms a registry of patches that attach
when speculators' modules are imported, in this process and (through the
``vllm.general_plugins`` entry point) in every vLLM worker process. Importing
specshim imports neither torch nor vllm. ``specshim.configure(...)`` (or the
``SPECSHIM_MAX_NUM_SEQS`` / ``SPECSHIM_MAX_BATCHED_TOKENS`` /
``SPECSHIM_CACHE_MEMORY_FRACTION`` variables) sets the step budget and KV-cache
fraction speculators hard-codes.
"""

from __future__ import annotations

from specshim._registry import (
    SpecShimError,
    SpecShimWarning,
    apply,
    records,
    registry,
    revert,
)
from specshim._settings import configure, load_environment, settings

TYPE_CHECKING = False  # typing costs ~15 ms to import; annotations are strings
if TYPE_CHECKING:
    from typing import Any

_LAZY = {
    "State": "specshim._types",
    "format_report": "specshim._report",
    "report": "specshim._report",
}


def __getattr__(name: str) -> Any:
    # Loaded on first use, so that ``import specshim`` stays cheap.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SpecShimError",
    "SpecShimWarning",
    "State",
    "apply",
    "configure",
    "format_report",
    "records",
    "registry",
    "report",
    "revert",
    "settings",
]

__version__ = "0.1.0"

apply()
load_environment()
