from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from specshim import _registry


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """An empty registry for throwaway patches; the real one comes back after."""
    real = _registry.REGISTRY
    real.load()  # the patch files register into the real one, not this
    real.revert()
    monkeypatch.delenv("SPECSHIM_DISABLE", raising=False)
    monkeypatch.delenv("SPECSHIM_STRICT", raising=False)
    monkeypatch.setattr(_registry, "REGISTRY", _registry.Registry())
    try:
        yield
    finally:
        _registry.REGISTRY.revert()
        monkeypatch.undo()
        real.apply()


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


BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    """Imports benchmarks/ modules the way the benchmark's scripts do."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(BENCHMARKS))
        for name in (
            "judge",
            "plan",
            "render",
            "gpu_summary",
            "gpu_models",
            "gpu_parts",
            "gpu_profiles",
            "reuse_bench",
            "profiled_extract",
        ):
            sys.modules.pop(name, None)
