"""How a patch file declares its patch: the docstring's headings and
``declare``, which makes the ``Patch`` record from them and the file's folder."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specshim._base import GENERATOR, WORKER, SpecShimError
from specshim._types import Patch, Probe

__all__ = ["HEADINGS", "declare", "headings"]


# The headings every patch file's docstring has, in this order. The text under
# them is the patch's record: the report, the patch table of
# docs/how-it-works.md and docs/drift.md are made from it.
HEADINGS = ("Why", "Upstream change", "Upstream PR", "Remove when")
# Each folder of patches targets one of speculators' modules, in one process;
# deps/ patches speculators' dependencies (module given) in every process.
_FOLDERS = {"main": GENERATOR, "worker": WORKER, "deps": None}
_PROCESS = {"main": "main", "worker": "worker", "deps": "main, worker"}


def headings(doc: str | None, where: str) -> dict[str, str]:
    """The text under each of ``HEADINGS`` in a docstring, as one line each.

    A heading is a line of its own ending in ``:``; its text is the indented
    lines below it. Missing, extra, empty or out-of-order headings are an error.
    """
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in (doc or "").splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            current = found.setdefault(line[:-1], [])
        elif current is not None and line.strip():
            if not line[0].isspace():
                raise SpecShimError(f"{where}: unindented text under a heading: {line}")
            current.append(line.strip())
    if tuple(found) != HEADINGS or not all(found.values()):
        raise SpecShimError(
            f"{where}: the docstring needs the headings {', '.join(HEADINGS)} "
            f"(each with text, in that order); found {list(found)}"
        )
    return {name: " ".join(lines) for name, lines in found.items()}


def declare(
    file: str,
    doc: str | None,
    *,
    id: str,  # noqa: A002 - the patch id
    attribute: str,
    versions: str,
    probe: Probe,
    build: Callable[[Any], Any],
    package: str = "vllm",
    drift_rows: tuple[int, ...] = (),
    optional: bool = False,
    replaces: bool = False,
    platform: str = "",
    module: str | None = None,
    requires: tuple[str, ...] = (),
) -> Patch:
    """The patch of the file ``file`` (its ``__name__``); ``patches/__init__``
    hands the set to the registry, in apply order.

    The process and target module follow from the folder (``main`` or
    ``worker``; a ``deps`` patch names its ``module`` and runs in every
    process); why, upstream change, upstream PR and remove-when come from the
    docstring's headings. Everything else is said here, once.
    """
    folder = file.rsplit(".", 2)[-2]
    if folder not in _FOLDERS:
        raise SpecShimError(f"{file}: patch files live in {sorted(_FOLDERS)}")
    if (module is None) != (_FOLDERS[folder] is not None):
        raise SpecShimError(f"{file}: only a deps/ patch names its module")
    text = headings(doc, file)
    return Patch(
        id=id,
        process=_PROCESS[folder],
        module=module or _FOLDERS[folder],
        attribute=attribute,
        package=package,
        versions=versions,
        probe=probe,
        build=build,
        why=doc or "",
        upstream=text["Upstream change"],
        remove_when=text["Remove when"],
        drift_rows=drift_rows,
        upstream_pr=text["Upstream PR"],
        optional=optional,
        replaces=replaces,
        platform=platform,
        requires=requires,
    )
