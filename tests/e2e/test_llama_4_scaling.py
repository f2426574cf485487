"""DeepSeek-V3-family configs with ``llama_4_scaling`` (Mistral-Large-3 style).

vLLM's ``DeepseekV2Model.forward`` computes a per-position query scale from
``config.llama_4_scaling`` and hands it to every decoder layer. A capture path
that re-implements the forward and drops it (as speculators' does) returns
plausible but wrong states. specshim captures with hooks on the model's own
forward, so the scaling must be in the captured states:

* same weights with and without the key: rows before the first scaled
  position are bit-identical, rows after it differ in every captured layer;
* against an independent reference (transformers with the query scaled per
  position by the same formula) every sequence passes the usual bar.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest

from specshim.job.verify.hf_reference import HFReference, mismatch, per_token_cosine

from .conftest import LAYERS, close_generator, make_generator

pytestmark = pytest.mark.e2e

SCALING = {"original_max_position_embeddings": 16, "beta": 2.0}
LENGTHS = (8, 16, 17, 40, 200, 600)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from specshim.testing.tiny_models import build_deepseek_v3

    root = tmp_path_factory.mktemp("llama4-scaling")
    scaled = build_deepseek_v3(root / "scaled", llama_4_scaling=SCALING)
    assert json.loads((scaled / "config.json").read_text())["llama_4_scaling"]
    # The same weights without the key: a copy with it removed from config.json.
    plain = root / "plain"
    shutil.copytree(scaled, plain)
    config = json.loads((plain / "config.json").read_text())
    del config["llama_4_scaling"]
    (plain / "config.json").write_text(json.dumps(config, indent=2))
    return scaled, plain


@pytest.fixture(scope="module")
def batch():
    rng = random.Random(11)
    return [[rng.randrange(300) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def captured(checkpoints, batch):
    out = {}
    for name, path in zip(("scaled", "plain"), checkpoints, strict=True):
        generator = make_generator(str(path), 1)
        try:
            out[name] = generator.generate(batch)
        finally:
            close_generator(generator)
    return out


def test_scaling_changes_exactly_the_scaled_positions(captured, batch):
    first_scaled = SCALING["original_max_position_embeddings"]
    for index, ids in enumerate(batch):
        scaled = captured["scaled"][index]["hidden_states"]
        plain = captured["plain"][index]["hidden_states"]
        for k, (a, b) in enumerate(zip(scaled, plain, strict=True)):
            where = f"sequence {index} (len {len(ids)}), layer #{k}"
            assert a.shape == b.shape == (len(ids), a.shape[-1]), where
            assert a[:first_scaled].equal(b[:first_scaled]), where
            if len(ids) > first_scaled:
                cos = per_token_cosine(a[first_scaled:], b[first_scaled:])
                assert not a[first_scaled:].equal(b[first_scaled:]), where
                assert cos.mean().item() < 0.9999, f"{where}: scaling had no effect"


def test_scaled_states_match_an_independent_reference(captured, checkpoints, batch):
    reference = HFReference(str(checkpoints[0]), apply_llama_4_scaling=True)
    failures = []
    for index, ids in enumerate(batch):
        why = mismatch(
            captured["scaled"][index]["hidden_states"], reference.states(ids, LAYERS)
        )
        if why:
            failures.append(f"sequence {index} (len {len(ids)}): {why}")
    assert not failures, "\n".join(failures)
