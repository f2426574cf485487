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
