from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from specshim import _registry


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An empty registry for throwaway patches; the real one comes back after."""
    _registry._load_patch_modules()
    saved = (
        dict(_registry._patches),
        dict(_registry._records),
        set(_registry._hooked_modules),
    )
    _registry.revert()
    _registry._patches.clear()
    _registry._records.clear()
    monkeypatch.delenv("SPECSHIM_DISABLE", raising=False)
    monkeypatch.delenv("SPECSHIM_STRICT", raising=False)
    try:
        yield
    finally:
        monkeypatch.delenv("SPECSHIM_DISABLE", raising=False)
        monkeypatch.delenv("SPECSHIM_STRICT", raising=False)
        _registry.revert()
        _registry._patches.clear()
        _registry._records.clear()
        _registry._patches.update(saved[0])
        _registry._records.update(saved[1])
        _registry._hooked_modules.clear()
        _registry._hooked_modules.update(saved[2])
        _registry.apply()


@pytest.fixture
def fake_module(tmp_path, monkeypatch):
    """Writes an importable module file and returns its name (not yet imported)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    counter = {"n": 0}

    def make(source: str) -> str:
        counter["n"] += 1
        name = f"specshim_fake_{tmp_path.name.replace('-', '_')}_{counter['n']}"
        (tmp_path / f"{name}.py").write_text(source)
        sys.modules.pop(name, None)
        return name

    return make
