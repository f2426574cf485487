"""The capture contract on the real CPU backend: float16 DeepSeek-family
layers rescale their residual stream, so the generator refuses them at set-up
(vLLM's CPU backend runs float16 on x86 and aarch64)."""

from __future__ import annotations

import json

import pytest

from .conftest import half_built, make_generator

pytestmark = pytest.mark.e2e


def test_float16_deepseek_is_refused_before_anything_is_captured(tmp_path):
    from specshim.testing.tiny_models import build_deepseek_v3

    path = build_deepseek_v3(tmp_path / "deepseek-fp16", routed_scaling_factor=2.5)
    config = json.loads((path / "config.json").read_text())
    config.update(torch_dtype="float16", dtype="float16")  # dtype="auto" -> fp16
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="run the model in bfloat16") as refused:
        make_generator(str(path), 1)
    message = str(refused.value)
    assert "routed_scaling_factor 2.5" in message
    # speculators' constructor failed after starting its worker, which would
    # otherwise spin for the rest of the session: specshim shut it down.
    generator = half_built(refused.value)
    assert generator is not None, "no half-built generator found"
    assert "executor" not in vars(generator), "its workers were left running"
