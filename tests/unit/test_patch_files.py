"""Every patch file explains itself: Why / Upstream change / Remove when."""

from __future__ import annotations

import pytest

import specshim
from specshim import patches

PATCH_FILES = [f"specshim.patches.main.{n}" for n in patches.MAIN] + [
    f"specshim.patches.worker.{n}" for n in patches.WORKER
]


@pytest.mark.parametrize("module_name", PATCH_FILES)
def test_patch_file_has_the_three_headings(module_name):
    import importlib

    doc = importlib.import_module(module_name).__doc__ or ""
    for heading in ("Why:", "Upstream change:", "Remove when:"):
        assert f"\n{heading}\n" in doc, f"{module_name} lacks {heading!r}"


def test_every_patch_file_registers_one_patch():
    ids = [p.id for p in specshim.registry()]
    assert len(ids) == len(PATCH_FILES) == len(set(ids))


# Rows of VLLM_DRIFT.md no patch answers: 19-21 arrive after the newest tested
# release (vLLM 0.24+: transformers 5, the warm-up, CPU MLA); 23 is vLLM's
# native extraction, another way to get states, not a break.
NOT_PATCHED = {19, 20, 21, 23}


def test_every_drift_row_is_covered():
    rows = {row for p in specshim.registry() for row in p.drift_rows}
    assert rows == set(range(1, 24)) - NOT_PATCHED


def test_kimi_fixture_carries_the_deepseek_text_weights(tmp_path):
    """The e2e tier compares Kimi-K2.5 with DeepSeek-V3: same seed, same weights."""
    import json

    from safetensors.torch import load_file

    from specshim.testing.tiny_models import (
        KIMI_VISION_CONFIG,
        build_deepseek_v3,
        build_kimi_k25,
        moonvit_weight_shapes,
    )

    kimi = load_file(str(build_kimi_k25(tmp_path / "kimi") / "model.safetensors"))
    text = load_file(str(build_deepseek_v3(tmp_path / "ds") / "model.safetensors"))
    assert {f"language_model.{name}" for name in text} <= set(kimi)
    for name, tensor in text.items():
        assert kimi[f"language_model.{name}"].equal(tensor), name
    vision = moonvit_weight_shapes(KIMI_VISION_CONFIG)
    assert set(kimi) == {f"language_model.{n}" for n in text} | set(vision)
    config = json.loads((tmp_path / "kimi" / "config.json").read_text())
    assert config["model_type"] == "kimi_k25"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "kimi")
    pad = tokenizer.convert_tokens_to_ids("<|media_pad|>")
    assert config["media_placeholder_token_id"] == pad
