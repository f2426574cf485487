"""The patch record, its gating, and the apply/revert machinery.

A patch replaces one attribute of one module (``module`` + dotted ``attribute``)
with a wrapper built from the original. It attaches lazily: a post-import hook
(``specshim._hooks``) fires when the target module is imported (or at once, if
it already is), so ``import specshim`` imports neither torch nor vllm. The patch
files themselves are loaded only when a hooked module is imported, or when
someone asks for the registry.

The probe on the live object decides whether a patch is needed; the version
range is advice that only shows up in the report.
"""

from __future__ import annotations

import sys
import threading
import warnings

from specshim import _hooks
from specshim._base import HOOKED_MODULES, SpecShimError, SpecShimWarning
from specshim._settings import disabled_ids, strict
from specshim._versions import installed_versions_line

TYPE_CHECKING = False  # typing costs ~15 ms to import; annotations are strings
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any

    from specshim._types import Patch, PatchRecord

# The patch record types live in ``_types`` (dataclasses and enum cost ~20 ms
# to import); they load with the first patch file, or on first use here.
_TYPE_NAMES = ("Incompatible", "NotNeeded", "Patch", "PatchRecord", "State")


def __getattr__(name: str) -> Any:
    if name in _TYPE_NAMES:
        from specshim import _types

        return getattr(_types, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _log() -> Any:
    import logging  # lazily: ~15 ms at import time

    return logging.getLogger(__name__)


__all__ = [
    "REGISTRY",
    "Patch",
    "PatchRecord",
    "Registry",
    "apply",
    "records",
    "register",
    "registry",
    "revert",
]


_MISSING = object()


class Registry:
    """The patches of one process and what became of each: one object, no globals.

    ``register`` adds a patch (``load`` registers the patch set it is handed;
    a patch file only declares its ``PATCH``); ``apply`` arms
    every patch (at once where the target module is loaded, else when it is
    imported); ``revert`` restores every original attribute and removes the
    import hooks, so that a reverted registry leaves no trace. ``loader``
    returns the patch set, in apply order, on first use (``specshim`` hands
    this process's registry the patch files' loader); a registry without one
    starts empty (the unit tests swap such a one in for throwaway patches).
    """

    def __init__(self, loader: Callable[[], Iterable[Patch]] | None = None) -> None:
        self._lock = threading.RLock()
        self._patches: dict[str, Patch] = {}
        self._records: dict[str, PatchRecord] = {}
        self._hooked: set[str] = set()
        self._loader = loader
        self._loaded = loader is None
        self.active = False

    def register(self, patch: Patch) -> Patch:
        from specshim._types import PatchRecord

        with self._lock:
            if patch.id in self._patches:
                raise SpecShimError(f"two patches share the id {patch.id!r}")
            for other in self._patches.values():
                same = other.target == patch.target
                if same and (other.replaces or patch.replaces):
                    raise SpecShimError(
                        f"patches {other.id!r} and {patch.id!r} both target "
                        f"{patch.target} and one of them replaces it outright; "
                        "they cannot both apply"
                    )
            self._patches[patch.id] = patch
            self._records[patch.id] = PatchRecord(patch)
        return patch

    def patches(self) -> list[Patch]:
        self.load()
        return list(self._patches.values())

    def records(self) -> list[PatchRecord]:
        self.load()
        return list(self._records.values())

    def record(self, patch_id: str) -> PatchRecord:
        self.load()
        return self._records[patch_id]

    @property
    def hooked_modules(self) -> frozenset[str]:
        return frozenset(self._hooked)

    def hand(self, loader: Callable[[], Iterable[Patch]]) -> None:
        """Give the registry the loader of its patch set (called on first use);
        once the set is loaded, another loader is refused (it would register
        the same patches twice)."""
        with self._lock:
            if self._loaded and self._loader is not None:
                raise SpecShimError(
                    "the registry has loaded its patch set already; hand it a "
                    "loader before its first use"
                )
            self._loader, self._loaded = loader, False

    def load(self) -> None:
        """Register the loader's patches (once), in the order it gives them."""
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            assert self._loader is not None
            for patch in self._loader():
                self.register(patch)
            stray = {p.module for p in self._patches.values()} - set(HOOKED_MODULES)
            if stray:
                raise SpecShimError(
                    f"patches target modules that are not hooked: {stray}"
                )
            self._check_requires()
            self._warn_unknown_disabled()

    def _check_requires(self) -> None:
        """Every patch a patch relies on is registered."""
        for patch in self._patches.values():
            unknown = [r for r in patch.requires if r not in self._patches]
            if unknown:
                raise SpecShimError(
                    f"patch {patch.id!r} requires unknown patch(es) {unknown}"
                )

    def turned_off_with(self, patch: Patch) -> list[str]:
        """The patches ``patch`` relies on, directly or not, that
        SPECSHIM_DISABLE turns off (then it is turned off with them)."""
        off, seen, todo = [], set(), list(patch.requires)
        while todo:
            needed = todo.pop(0)
            if needed in seen or needed not in self._patches:
                continue
            seen.add(needed)
            if needed in disabled_ids():
                off.append(needed)
            todo.extend(self._patches[needed].requires)
        return off

    def apply(self) -> None:
        """Arm every patch. Idempotent; safe to call from every vLLM process."""
        with self._lock:
            self.active = True
            if self._loaded:
                self._warn_unknown_disabled()
            targets = [*HOOKED_MODULES, *(p.module for p in self._patches.values())]
            for module in dict.fromkeys(targets):
                if module not in self._hooked:
                    self._hooked.add(module)
                    # Fires at once if the module is already imported.
                    _hooks.when_imported(module, self._on_import)
                elif module in sys.modules:
                    self._on_import(sys.modules[module])

    def revert(self) -> None:
        """Restore every original attribute and remove the import hooks."""
        from specshim._types import State

        with self._lock:
            self.active = False
            for module in self._hooked:
                _hooks.forget(module, self._on_import)
            self._hooked.clear()
            for record in reversed(list(self._records.values())):
                if record.state is State.APPLIED:
                    _restore(record)
                record.state, record.detail = State.PENDING, ""
                record.owner = record.original = None

    def _warn_unknown_disabled(self) -> None:
        unknown = disabled_ids() - set(self._patches) - {"all"}
        if unknown:
            warnings.warn(
                f"SPECSHIM_DISABLE names unknown patches: {sorted(unknown)}; "
                f"known ids: {sorted(self._patches)}",
                SpecShimWarning,
                stacklevel=4,
            )

    def _on_import(self, module: Any) -> None:
        from specshim._types import State

        with self._lock:
            if not self.active:
                return
            self.load()
            applied = []
            for record in self._records.values():
                pending = record.state is State.PENDING
                if record.patch.module == module.__name__ and pending:
                    _apply_one(record, module, self)
                    if record.state is State.APPLIED:
                        applied.append(record.patch.id)
        if applied:
            _log().info(
                "specshim: applied %d patch(es) to %s: %s",
                len(applied),
                module.__name__,
                ", ".join(applied),
            )


# This process's registry. Everything below goes through it; ``specshim``
# hands it the loader of the patch set on import; a test swaps in another with
# ``monkeypatch.setattr(_registry, "REGISTRY", Registry())``.
REGISTRY = Registry()


def register(patch: Patch) -> Patch:
    """Add a patch to the registry (at import of its file)."""
    return REGISTRY.register(patch)


def registry() -> list[Patch]:
    """Every registered patch, in apply order."""
    return REGISTRY.patches()


def records() -> list[PatchRecord]:
    """Each patch's state in this process, in apply order."""
    return REGISTRY.records()


def apply() -> None:
    """Arm every patch: apply now where the target module is loaded, else on import."""
    REGISTRY.apply()


def revert() -> None:
    """Restore every original attribute and stop patching future imports."""
    REGISTRY.revert()


def _apply_one(record: PatchRecord, module: Any, registry: Registry) -> None:
    from specshim._types import Incompatible, NotNeeded, State

    patch = record.patch
    if patch.id in disabled_ids() or "all" in disabled_ids():
        record.state, record.detail = State.DISABLED, "SPECSHIM_DISABLE"
        return
    needed_off = registry.turned_off_with(patch)
    if needed_off:
        record.state = State.DISABLED
        record.detail = (
            f"needs {', '.join(needed_off)}, which SPECSHIM_DISABLE turns off"
        )
        return
    try:
        owner, name = _resolve_owner(module, patch.attribute)
    except AttributeError as exc:
        record.state, record.detail = State.INCOMPATIBLE, str(exc)
        _complain(
            record, f"{patch.attribute} in {patch.module}", f"no such name ({exc})"
        )
        return
    original = getattr(owner, name, _MISSING)
    try:
        patch.probe(None if original is _MISSING else original)
    except NotNeeded as exc:
        record.state, record.detail = State.NOT_NEEDED, str(exc)
        return
    except Incompatible as exc:
        record.state, record.detail = State.INCOMPATIBLE, str(exc)
        _complain(record, exc.expected, exc.found)
        return
    except Exception as exc:
        # A probe that crashes is a specshim bug or a shape nobody foresaw; it
        # must not pass for "no such name" nor escape without the diagnosis.
        record.state, record.detail = State.FAILED, f"{type(exc).__name__}: {exc}"
        _complain(record, "a probe that runs to a verdict", record.detail)
        return
    owned, raw = _own_value(owner, name, original)  # before it is replaced
    try:
        replacement = patch.build(None if original is _MISSING else original)
        setattr(owner, name, replacement)
    except Exception as exc:
        record.state, record.detail = State.FAILED, f"{type(exc).__name__}: {exc}"
        _complain(record, "the replacement to build and install", record.detail)
        return
    record.owner, record.original = owner, original
    record.had_attribute = original is not _MISSING
    record.owned, record.raw = owned, raw
    record.state = State.APPLIED
    record.detail = "replaced" if record.had_attribute else "added"
    _log().debug("specshim: %s %s (%s)", record.detail, patch.target, patch.id)


def _resolve_owner(module: Any, attribute: str) -> tuple[Any, str]:
    *path, name = attribute.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _own_value(owner: Any, name: str, found: Any) -> tuple[bool, Any]:
    """What ``owner`` itself holds under ``name``. A class is read through its
    own ``__dict__`` (the MRO lookup that ``getattr`` does would hand back an
    inherited function, or a classmethod already bound); a module's attribute
    is its own."""
    if isinstance(owner, type):
        own = vars(owner)
        return name in own, own.get(name)
    return found is not _MISSING, None if found is _MISSING else found


def _restore(record: PatchRecord) -> None:
    """Put back exactly what the owner held: its own value (a descriptor as
    it was), or nothing, so that an inherited attribute is inherited again."""
    name = record.patch.attribute.rsplit(".", 1)[-1]
    if record.owned:
        setattr(record.owner, name, record.raw)
    else:
        delattr(record.owner, name)


def _complain(record: PatchRecord, expected: str, found: str) -> None:
    patch = record.patch
    message = (
        f"specshim patch {patch.id!r} cannot apply ({record.state.value}).\n"
        f"  target:    {patch.target} (runs in the {patch.process} process)\n"
        f"  expected:  {expected}\n"
        f"  found:     {found}\n"
        f"  installed: {installed_versions_line()}\n"
        f"  meant for: {patch.package} {patch.versions}\n"
        f"  to override: SPECSHIM_DISABLE={patch.id} skips this patch (at your "
        "own risk); `python -m specshim doctor` shows every patch's state."
    )
    if patch.optional and not strict():
        warnings.warn(message, SpecShimWarning, stacklevel=3)
        return
    raise SpecShimError(message)
