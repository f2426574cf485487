"""Small helpers shared by the patch files."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from specshim._base import GENERATOR, WORKER
from specshim._types import Incompatible

__all__ = [
    "GENERATOR",
    "WORKER",
    "adapt_kwargs",
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
