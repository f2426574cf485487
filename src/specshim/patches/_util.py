"""Small helpers shared by the patch files."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from specshim._base import GENERATOR, WORKER, SpecShimError
from specshim._registry import register
from specshim._types import Incompatible, Patch, Probe

__all__ = [
    "GENERATOR",
    "HEADINGS",
    "WORKER",
    "adapt_kwargs",
    "declare",
    "headings",
    "parameters",
    "require_callable",
    "required",
    "signature_text",
    "upstream",
    "wrap_call",
    "wrap_result",
]


def upstream(obj: Any) -> Any:
    """Follow ``__wrapped__`` through specshim's own wrappers to vLLM's object."""
    while hasattr(obj, "__wrapped__") and getattr(obj, "__specshim__", False):
        obj = obj.__wrapped__
    return obj


def parameters(obj: Any) -> dict[str, inspect.Parameter]:
    """The call parameters of the upstream callable (a class: its constructor)."""
    target = upstream(obj)
    if target is None:
        raise Incompatible("a callable", "nothing (the name is missing)")
    try:
        return dict(inspect.signature(target).parameters)
    except (TypeError, ValueError) as exc:
        raise Incompatible("an introspectable signature", repr(exc)) from exc


def signature_text(obj: Any) -> str:
    target = upstream(obj)
    try:
        return f"{getattr(target, '__qualname__', target)}{inspect.signature(target)}"
    except (TypeError, ValueError):
        return repr(target)


def required(param: inspect.Parameter) -> bool:
    return param.default is inspect.Parameter.empty and param.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.KEYWORD_ONLY,
    )


def adapt_kwargs(
    original: Callable[..., Any],
    adapt: Callable[[dict[str, Any]], dict[str, Any]],
) -> Callable[..., Any]:
    """A callable that rewrites keyword arguments before calling ``original``.

    speculators calls every patched constructor with keywords only, so the
    wrappers only need to see keywords.
    """

    @functools.wraps(original, updated=())
    def call(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **adapt(dict(kwargs)))

    call.__specshim__ = True  # type: ignore[attr-defined]
    return call


def wrap_result(
    original: Callable[..., Any], after: Callable[[Any], Any]
) -> Callable[..., Any]:
    """A callable that post-processes what ``original`` returns."""

    @functools.wraps(original, updated=())
    def call(*args: Any, **kwargs: Any) -> Any:
        return after(original(*args, **kwargs))

    call.__specshim__ = True  # type: ignore[attr-defined]
    return call


def wrap_call(
    original: Callable[..., Any],
    before: Callable[[tuple[Any, ...], dict[str, Any]], None],
) -> Callable[..., Any]:
    """A callable (usable as a method) that runs ``before`` and then ``original``."""

    @functools.wraps(original, updated=())
    def call(*args: Any, **kwargs: Any) -> Any:
        before(args, kwargs)
        return original(*args, **kwargs)

    call.__specshim__ = True  # type: ignore[attr-defined]
    return call


def require_callable(expected: str) -> Callable[[Any], None]:
    """A probe: the target must exist and be callable (``expected`` names it)."""

    def probe(original: Any) -> None:
        if original is None or not callable(original):
            raise Incompatible(expected, repr(original))

    return probe


# The headings every patch file's docstring has, in this order. The text under
# them is the patch's record: the report, the README table and docs/drift.md
# are made from it.
HEADINGS = ("Why", "Upstream change", "Upstream PR", "Remove when")
# Each folder of patches targets one of speculators' modules, in one process.
_FOLDERS = {"main": GENERATOR, "worker": WORKER}


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
) -> Patch:
    """Register the patch of the file ``file`` (its ``__name__``).

    The process and target module follow from the folder (``main`` or
    ``worker``); why, upstream change, upstream PR and remove-when come from
    the docstring's headings. Everything else is said here, once.
    """
    folder = file.rsplit(".", 2)[-2]
    if folder not in _FOLDERS:
        raise SpecShimError(f"{file}: patch files live in {sorted(_FOLDERS)}")
    text = headings(doc, file)
    return register(
        Patch(
            id=id,
            process=folder,
            module=_FOLDERS[folder],
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
        )
    )
