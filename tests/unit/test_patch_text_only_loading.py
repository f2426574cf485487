"""The text_only_loading patch, against ModelConfig fakes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specshim._types import Incompatible


class ModelConfigFake:
    """Records the limits it was built with; multimodal when ``modalities``."""

    def __init__(self, model, limit_mm_per_prompt=None, modalities=()):
        self.model = model
        self.architecture = "FakeForConditionalGeneration"
        self.limits = limit_mm_per_prompt
        self.multimodal_config = SimpleNamespace() if modalities else None
        self.modalities = list(modalities)


def _fake_modalities(config):
    return config.modalities


def test_text_only_loading_limits_every_supported_modality(monkeypatch):
    from specshim.patches.main import text_only_loading

    monkeypatch.setattr(text_only_loading, "supported_modalities", _fake_modalities)
    build = text_only_loading.PATCH.build(ModelConfigFake)
    kimi = build(model="kimi", modalities=("vision_chunk",))
    assert kimi.limits == {"vision_chunk": 0}
    both = build(model="vl", modalities=("image", "video"))
    assert both.limits == {"image": 0, "video": 0}


def test_text_only_loading_leaves_text_models_and_caller_limits(monkeypatch):
    from specshim.patches.main import text_only_loading

    monkeypatch.setattr(text_only_loading, "supported_modalities", _fake_modalities)
    build = text_only_loading.PATCH.build(ModelConfigFake)
    assert build(model="llama").limits is None
    chosen = build(model="kimi", modalities=("vision_chunk",), limit_mm_per_prompt={})
    assert chosen.limits == {}


class ModelConfig017(ModelConfigFake):
    """vLLM 0.17's shape: ``language_model_only`` limits every modality."""

    def __init__(
        self, model, limit_mm_per_prompt=None, language_model_only=False, modalities=()
    ):
        super().__init__(model, limit_mm_per_prompt, modalities)
        self.text_only = language_model_only


def test_text_only_loading_uses_language_model_only_where_it_exists(monkeypatch):
    from specshim.patches.main import text_only_loading

    def never(config):
        raise AssertionError("no processor is needed with language_model_only")

    monkeypatch.setattr(text_only_loading, "supported_modalities", never)
    build = text_only_loading.PATCH.build(ModelConfig017)
    kimi = build(model="kimi", modalities=("vision_chunk",))
    assert kimi.text_only is True and kimi.limits is None
    # What the caller chose stands.
    assert build(model="kimi", limit_mm_per_prompt={}).text_only is False
    assert build(model="kimi", language_model_only=False).text_only is False


def test_text_only_loading_needs_the_limit_parameter():
    from specshim.patches.main import text_only_loading

    def model_config(model, tokenizer=None):  # no limit_mm_per_prompt
        return None

    with pytest.raises(Incompatible):
        text_only_loading.PATCH.probe(model_config)
