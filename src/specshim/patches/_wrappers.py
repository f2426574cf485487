"""The wrappers and probes patch files build from: reading a signature,
wrapping a callable or a method so that ``upstream`` finds vLLM's object
under it, forcing or defaulting keyword arguments."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import wrapt

from specshim._base import GENERATOR, WORKER
from specshim._types import Incompatible, NotNeeded

__all__ = [
    "GENERATOR",
    "WORKER",
    "adapt_kwargs",
    "force_keyword",
    "keyword_default",
    "parameters",
    "require_callable",
    "required",
    "signature_text",
    "upstream",
    "view_method",
    "wrap",
    "wrap_call",
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


class _Wrapper(wrapt.FunctionWrapper):  # type: ignore[misc]
    """specshim's wrapper of a callable. A wrapped class stays a class:
    ``inspect.isclass``, ``isinstance`` and subclassing work through it, and
    ``upstream`` finds what it wraps."""

    __specshim__ = True


def wrap(
    original: Any,
    call: Callable[[Any, tuple[Any, ...], dict[str, Any]], Any],
) -> Any:
    """``original`` (a class or function) called as ``call(original, args, kwargs)``."""
    return _Wrapper(
        original, lambda wrapped, _, args, kwargs: call(wrapped, args, kwargs)
    )


def adapt_kwargs(
    original: Any,
    adapt: Callable[[dict[str, Any]], dict[str, Any]],
) -> Any:
    """A callable that rewrites keyword arguments before calling ``original``.

    speculators calls every patched constructor with keywords only, so the
    wrappers only need to see keywords.
    """
    return wrap(original, lambda wrapped, args, kw: wrapped(*args, **adapt(dict(kw))))


def force_keyword(name: str, value: Any) -> Callable[[Any], Any]:
    """A build: every call through the patched name passes ``name=value``."""

    def forced(kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs[name] = value
        return kwargs

    return lambda original: adapt_kwargs(original, forced)


def keyword_default(original: Any, name: str, *, required: bool) -> Any:
    """The default of ``original``'s keyword ``name``, for a probe.

    A missing keyword is ``Incompatible`` if ``required``, else ``NotNeeded``.
    """
    params = parameters(original)
    if name not in params:
        found = f"no {name} parameter in {signature_text(original)}"
        if required:
            raise Incompatible(f"the keyword {name}=", found)
        raise NotNeeded(found)
    return params[name].default


class _View(wrapt.ObjectProxy):  # type: ignore[misc]
    """An instance seen through specshim: the methods patches override."""


class _ViewFactory(_Wrapper):
    """A class whose instances come back as one ``_View``."""


def view_method(original: Any, name: str, method: Callable[..., Any]) -> Any:
    """A build for a class: its instances come back seen through one proxy, on
    which ``name(...)`` calls ``method(instance, ...)``.

    Several patches on the same class add their methods to that one proxy
    rather than stacking proxies. Only the caller holding the proxy sees the
    methods: the instance's own calls to ``self.name`` reach the original.
    """
    methods: dict[str, Callable[..., Any]] = {}
    if type(original) is _ViewFactory:
        methods.update(original._self_methods)
        original = original.__wrapped__
    methods[name] = method
    view = type("SpecShimView", (_View,), {n: _forward(m) for n, m in methods.items()})
    factory = _ViewFactory(
        original, lambda wrapped, _, args, kwargs: view(wrapped(*args, **kwargs))
    )
    factory._self_methods = methods
    return factory


def _forward(method: Callable[..., Any]) -> Callable[..., Any]:
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return method(self.__wrapped__, *args, **kwargs)

    call.__name__ = call.__qualname__ = method.__name__
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
