"""What happens without specshim, and without its two correctness guards."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

import specshim

from .checks import mismatch
from .conftest import LAYERS, close_generator, make_generator

pytestmark = pytest.mark.e2e


def test_unpatched_speculators_fails_loudly_on_vllm_016(tiny_model_dir):
    code = (
        "from speculators.data_generation import VllmHiddenStatesGenerator as G\n"
        f"G({str(tiny_model_dir('llama'))!r}, layer_ids=[1], max_model_len=256)\n"
    )
    env = dict(os.environ, SPECSHIM_DISABLE="all", VLLM_PLUGINS="")
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    # Row 1 of the drift table is the first thing that breaks.
    assert "ValidationError" in out.stderr and "is_encoder_decoder" in out.stderr


@pytest.fixture
def shim_without(monkeypatch):
    """Re-arm specshim with some patches disabled (also in the workers)."""

    def set_disabled(ids: str) -> None:
        monkeypatch.setenv("SPECSHIM_DISABLE", ids)
        specshim.revert()
        specshim.apply()

    yield set_disabled
    monkeypatch.delenv("SPECSHIM_DISABLE")
    specshim.revert()
    specshim.apply()


def _over_budget_batch() -> list[list[int]]:
    rng = random.Random(11)
    return [
        [rng.randrange(300) for _ in range(rng.randint(700, 1000))] for _ in range(12)
    ]


def test_chunked_prefill_without_guards_corrupts_silently(
    shim_without, tiny_model_dir, hf_reference
):
    shim_without("chunked-prefill-off,generate-guard")
    path = tiny_model_dir("llama")
    generator = make_generator(str(path), 1)
    try:
        batch = _over_budget_batch()
        results = generator.generate(batch)  # no error: that is the danger
    finally:
        close_generator(generator)
    reference = hf_reference(path)
    bad = [
        i
        for i, ids in enumerate(batch)
        if mismatch(results[i]["hidden_states"], reference.states(ids, LAYERS))
    ]
    assert bad, "expected misaligned rows with chunked prefill on"


def test_generate_guard_refuses_what_chunked_prefill_did(shim_without, tiny_model_dir):
    shim_without("chunked-prefill-off")
    generator = make_generator(str(tiny_model_dir("llama")), 1)
    try:
        with pytest.raises(specshim.SpecShimError, match="do not line up"):
            generator.generate(_over_budget_batch())
        # The generator is still usable afterwards.
        assert len(generator.generate([[1, 2, 3]])[0]["hidden_states"][0]) == 3
    finally:
        close_generator(generator)
