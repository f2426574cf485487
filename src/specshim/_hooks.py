"""Run callbacks right after a named module is imported (post-import hooks).

A small ``sys.meta_path`` finder, so that ``import specshim`` stays cheap: it
needs nothing beyond ``importlib.util`` (wrapt's importer pulls in asyncio and
``importlib.metadata``, ~100 ms on a slow machine). The finder only answers for
watched module names: it asks the rest of ``sys.meta_path`` for the spec and
wraps its loader so that the callbacks run once the module body has executed.
"""

from __future__ import annotations

import importlib.util
import sys
import threading

TYPE_CHECKING = False  # typing costs ~15 ms to import; annotations are strings
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    Callback = Callable[[Any], None]

_lock = threading.RLock()
_callbacks: dict[str, list[Callback]] = {}
_searching: set[str] = set()  # names being resolved by the other finders


class _Loader:
    """Delegates to the real loader; fires the callbacks after ``exec_module``."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # Later imports, reloads and introspection see the real loader.
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        _fire(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class _Finder:
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        with _lock:
            if fullname not in _callbacks or fullname in _searching:
                return None
            _searching.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            with _lock:
                _searching.discard(fullname)
        if spec is None or spec.loader is None or isinstance(spec.loader, _Loader):
            return spec
        spec.loader = _Loader(spec.loader)
        return spec

    def invalidate_caches(self) -> None:
        return None


_finder = _Finder()


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``name`` is imported (now, if it already is)."""
    with _lock:
        _callbacks.setdefault(name, []).append(callback)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        module = sys.modules.get(name)
    if module is not None and getattr(module, "__spec__", None) is not None:
        callback(module)


def forget(name: str, callback: Callback) -> None:
    """Undo ``when_imported``; the finder leaves ``sys.meta_path`` with the last."""
    with _lock:
        callbacks = _callbacks.get(name, [])
        while callback in callbacks:
            callbacks.remove(callback)
        if not callbacks:
            _callbacks.pop(name, None)
        if not _callbacks and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)


def _fire(module: Any) -> None:
    with _lock:
        callbacks = list(_callbacks.get(module.__name__, ()))
    for callback in callbacks:
        callback(module)
