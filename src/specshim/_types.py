"""The patch declaration and its per-process record."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Incompatible", "NotNeeded", "Patch", "PatchRecord", "State"]


class NotNeeded(Exception):  # noqa: N818 - a probe outcome, not an error
    """Raised by a probe: the upstream change is absent, leave the target alone."""


class Incompatible(Exception):  # noqa: N818 - a probe outcome, turned into an error
    """Raised by a probe: the target has a shape this patch does not know."""

    def __init__(self, expected: str, found: str) -> None:
        super().__init__(f"expected {expected}; found {found}")
        self.expected = expected
        self.found = found


class State(str, enum.Enum):
    PENDING = "pending"  # target module not imported in this process (yet)
    APPLIED = "applied"
    NOT_NEEDED = "not needed"
    DISABLED = "disabled"
    INCOMPATIBLE = "incompatible"
    FAILED = "failed"


Probe = Callable[[Any], None]
Build = Callable[[Any], Any]


@dataclass(frozen=True)
class Patch:
    """One fix for one upstream change, declared next to its explanation.

    ``probe(original)`` returns if the patch is needed and applicable, raises
    ``NotNeeded`` if the upstream change is absent, or ``Incompatible`` if the
    target looks like nothing this patch was written for. ``build(original)``
    returns the replacement. ``replaces`` marks a full replacement: no other
    patch may target the same attribute. Otherwise wrappers stack in order.
    """

    id: str
    process: str  # "main" or "worker"
    module: str
    attribute: str
    package: str
    versions: str
    probe: Probe
    build: Build
    why: str  # the patch file's docstring
    upstream: str  # what changed upstream, and in which release
    remove_when: str
    drift_rows: tuple[int, ...] = ()
    upstream_pr: str = ""  # the PR(s) that made the change, or why there is none
    optional: bool = False
    replaces: bool = False
    platform: str = ""  # "cpu": needed only on that vLLM platform
    # Patches this one relies on: turned off with any of them (SPECSHIM_DISABLE).
    requires: tuple[str, ...] = ()

    @property
    def summary(self) -> str:
        """The first line of the patch file's docstring."""
        return self.why.strip().split("\n", 1)[0]

    @property
    def target(self) -> str:
        return f"{self.module}:{self.attribute}"


@dataclass
class PatchRecord:
    patch: Patch
    state: State = State.PENDING
    detail: str = ""
    owner: Any = field(default=None, repr=False)
    original: Any = field(default=None, repr=False)
    had_attribute: bool = True
    # What the owner itself held under the name (a class's own ``__dict__``
    # entry, a classmethod as the descriptor), restored on revert; ``owned``
    # False: the name was inherited or absent, and revert deletes it again.
    owned: bool = True
    raw: Any = field(default=None, repr=False)
