"""Every patch file explains itself, once: Why / Upstream change / Upstream PR /
Remove when, and the drift table made from them."""

from __future__ import annotations

from pathlib import Path

import pytest

import specshim
from specshim import patches
from specshim._base import GENERATOR, HOOKED_MODULES, WORKER, SpecShimError

DRIFT_DOC = Path(__file__).resolve().parents[2] / "docs" / "drift.md"

PATCH_FILES = [m.__name__ for m in (*patches.DEPS, *patches.MAIN, *patches.WORKER)]


@pytest.mark.parametrize("module_name", PATCH_FILES)
def test_patch_file_declares_its_patch_once(module_name):
    """Docstring headings, folder and ``declare`` are the patch's only record."""
    import importlib
    import re

    from specshim.patches._declare import headings

    module = importlib.import_module(module_name)
    text = headings(module.__doc__, module_name)
    patch = module.PATCH
    assert patch.why == module.__doc__
    assert (patch.upstream, patch.remove_when, patch.upstream_pr) == (
        text["Upstream change"],
        text["Remove when"],
        text["Upstream PR"],
    )
    folder = module_name.split(".")[-2]
    if folder == "deps":  # speculators' dependencies, in every process
        assert patch.process == "main, worker"
        assert patch.module in HOOKED_MODULES
    else:
        assert patch.process == folder
        assert patch.module == {"main": GENERATOR, "worker": WORKER}[folder]
    # A PR is cited by its full reference, or its absence is said plainly.
    cited = re.findall(r"[\w-]+/[\w-]+#\d+|(?<![/\w])#\d+", patch.upstream_pr)
    assert all("/" in ref for ref in cited), cited
    assert cited or patch.upstream_pr.startswith(("none", "not found")), patch.id


def test_headings_are_required_in_order_and_filled():
    from specshim.patches._declare import headings

    good = "x\n\nWhy:\n    a\nUpstream change:\n    b\nUpstream PR:\n    c\n"
    assert headings(good + "Remove when:\n    d\n    e\n", "f")["Remove when"] == "d e"
    for bad in (
        good,  # no Remove when
        good + "Remove when:\n",  # empty
        good.replace("Upstream PR:\n    c\n", "") + "Upstream PR:\n    c\n",
        good + "Remove when:\n    d\nExtra:\n    e\n",
    ):
        with pytest.raises(SpecShimError, match="needs the headings"):
            headings(bad, "f")


def test_every_patch_file_registers_one_patch():
    ids = [p.id for p in specshim.registry()]
    assert len(ids) == len(PATCH_FILES) == len(set(ids))


def test_every_drift_row_is_covered_once():
    """Each row is answered by a patch, or said to need none (docs/drift.md)."""
    rows = [row for p in specshim.registry() for row in p.drift_rows]
    assert len(rows) == len(set(rows))
    assert set(rows) | set(patches.UNPATCHED_DRIFT) == set(range(1, 29))
    assert not set(rows) & set(patches.UNPATCHED_DRIFT)


def test_drift_doc_is_generated_and_current():
    from specshim._table import render_into

    text = DRIFT_DOC.read_text()
    assert render_into(text, "docs/drift.md") == text, (
        "run: python -m specshim table --write docs/drift.md"
    )
    for patch in specshim.registry():
        assert f"`{patch.id}`" in text


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
