"""specshim: run speculators 0.3.0's hidden-state generator on newer vLLM.

``import specshim`` before speculators arms a registry of patches that attach
when speculators' modules are imported, in this process and (through the
``vllm.general_plugins`` entry point) in every vLLM worker process. Importing
specshim imports neither torch nor vllm.
"""

from __future__ import annotations

from specshim._registry import (
    SpecShimError,
    SpecShimWarning,
    State,
    apply,
    records,
    registry,
    revert,
)
from specshim._report import format_report, report

__all__ = [
    "SpecShimError",
    "SpecShimWarning",
    "State",
    "apply",
    "format_report",
    "records",
    "registry",
    "report",
    "revert",
]

__version__ = "0.1.0"

apply()
