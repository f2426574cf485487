"""specshim: run speculators 0.3.0's hidden-state generator on newer vLLM.

``import specshim`` before speculators arms a registry of patches that attach
when speculators' modules are imported, in this process and (through the
``vllm.general_plugins`` entry point) in every vLLM worker process. Importing
specshim imports neither torch nor vllm. ``specshim.configure(...)`` (or
``with specshim.configured(...)`` for one block, or the ``SPECSHIM_*``
variables in ``specshim._settings.KNOBS``) sets the step budget and KV-cache
fraction speculators hard-codes. ``specshim.revert()`` undoes all of it.
``specshim.close(generator)`` shuts a generator's workers down (an open one is
closed at exit anyway).
"""

from __future__ import annotations

from specshim import _registry, _settings
from specshim._base import SpecShimError, SpecShimWarning
from specshim._registry import records, registry
from specshim._settings import configure, configured, settings

TYPE_CHECKING = False  # typing costs ~15 ms to import; annotations are strings
if TYPE_CHECKING:
    from typing import Any

_LAZY = {
    "State": "specshim._types",
    "close": "specshim._closing",
    "format_report": "specshim._report",
    "report": "specshim._report",
}


def __getattr__(name: str) -> Any:
    # Loaded on first use, so that ``import specshim`` stays cheap.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _patch_set() -> Any:
    """The patch files' patches, in apply order: imported on the registry's
    first use (a hooked module's import, or a report), not by ``import
    specshim``."""
    from specshim import patches

    return patches.PATCHES


_registry.REGISTRY.hand(_patch_set)


def apply() -> None:
    """Arm the patches and the settings: what ``import specshim`` does.

    Idempotent; the vLLM plugin calls it in every worker process.
    """
    _registry.apply()
    _settings.arm()


def revert() -> None:
    """Undo everything ``apply`` and ``configure`` did.

    Every patched attribute is restored, the import hooks are removed and
    speculators' constants are back to its own values. ``apply()`` re-arms.
    """
    _settings.disarm()
    _registry.revert()


__all__ = [
    "SpecShimError",
    "SpecShimWarning",
    "State",
    "apply",
    "close",
    "configure",
    "configured",
    "format_report",
    "records",
    "registry",
    "report",
    "revert",
    "settings",
]

__version__ = "0.1.0"

apply()
