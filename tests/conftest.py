"""Shared fixtures: tiny checkpoints built once per session, offline."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

# Keep vLLM's CPU KV cache small and never reach for a model hub.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """Returns a builder: name -> checkpoint directory (built on first use)."""
    from specshim.testing.tiny_models import BUILDERS

    root = tmp_path_factory.mktemp("tiny-models")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = BUILDERS[name](root / name)
        return built[name]

    return get


@pytest.fixture(scope="session")
def hf_reference() -> Any:
    from specshim.job.verify.hf_reference import HFReference

    cache: dict[str, HFReference] = {}

    def get(path: Any) -> HFReference:
        key = str(path)
        if key not in cache:
            cache[key] = HFReference(key)
        return cache[key]

    return get


def pytest_collection_modifyitems(config: pytest.Config, items: list[Any]) -> None:
    """Under pytest-xdist (``make test``: ``-n JOBS --dist loadgroup``), the
    unit of work a process takes is a test file, as its tests share module
    fixtures (an engine, a tampered output), except that the reference cases
    go a generator (tests/e2e/conftest.py: one engine each, module-scoped) to
    a unit: they are most of the tier's time and need nothing of each other."""
    if not config.pluginmanager.has_plugin("xdist"):
        return  # (the matrix's environments run without it)
    for item in items:
        group = item.nodeid.split("::")[0]
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "generator" in callspec.params:
            group += f"[{callspec.params['generator']}]"
        item.add_marker(pytest.mark.xdist_group(group))
