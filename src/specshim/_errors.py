"""specshim's exceptions and warning, in a module that imports nothing."""

from __future__ import annotations

__all__ = ["SpecShimError", "SpecShimWarning", "UsageError"]


class SpecShimError(RuntimeError):
    """A patch could not be applied, or specshim refused unsafe input."""


class UsageError(SpecShimError):
    """The command was called wrongly: a flag, a path or the input data.

    The command line exits with 2 for these and with 1 for other failures.
    """


class SpecShimWarning(UserWarning):
    """An optional patch could not be applied."""
