"""Kimi-K2.5: a multimodal wrapper around a DeepSeek-V3 text model.

The tiny fixture's text weights are exactly the tiny DeepSeek-V3's. Through the
unmodified speculators generator, the wrapper must give the *same* hidden
states as the plain DeepSeek-V3 (the HF comparison for every batch case runs in
``test_reference_match``), and with ``text-only-loading`` its vision tower must
not be built at all. With that patch disabled the tower is built, and the
states are still the same.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import pytest

from specshim.testing.worker_probes import tower_parameter_count

from .conftest import LAYERS, MAX_MODEL_LEN, close_generator, make_generator

pytestmark = pytest.mark.e2e


def _batch() -> list[list[int]]:
    """Shared prefix, duplicates, one-token rows and more than a step's budget."""
    rng = random.Random(21)
    system = [rng.randrange(300) for _ in range(64)]
    prompt = [rng.randrange(300) for _ in range(40)]
    long = [
        [rng.randrange(300) for _ in range(rng.randint(700, MAX_MODEL_LEN - 1))]
        for _ in range(11)
    ]
    tails = [[rng.randrange(300) for _ in range(rng.randint(1, 30))] for _ in range(4)]
    return [*(system + t for t in tails), prompt, [5], prompt, *long, [5]]


def _run(path: str, tp: int) -> tuple[list[int], list[dict]]:
    generator = make_generator(path, tp, trust_remote_code="kimi" in path)
    try:
        towers = generator.executor.collective_rpc(tower_parameter_count)
        return towers, generator.generate(_batch())
    finally:
        close_generator(generator)


def _assert_identical(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) == len(_batch())
    for index, (x, y) in enumerate(zip(a, b, strict=True)):
        assert x["input_ids"].equal(y["input_ids"]), index
        layers = zip(x["hidden_states"], y["hidden_states"], strict=True)
        for k, (p, q) in enumerate(layers):
            assert p.equal(q), f"sequence {index}, layer #{k}"


# TP=2 is `extended` (make test-extended): the text-only loading is the same
# code in every worker, and make test runs Kimi-K2.5 at TP=1.
@pytest.mark.parametrize(
    "tp", [1, pytest.param(2, marks=(pytest.mark.tp2, pytest.mark.extended))]
)
def test_kimi_k25_equals_deepseek_v3_without_building_its_tower(tiny_model_dir, tp):
    towers, kimi = _run(str(tiny_model_dir("kimi_k25")), tp)
    assert towers == [0] * tp, "the vision tower was built for a text-only job"
    _, deepseek = _run(str(tiny_model_dir("deepseek_v3")), tp)
    _assert_identical(kimi, deepseek)


_DISABLED = textwrap.dedent(
    """
    import json, sys, torch
    from specshim.testing.worker_probes import tower_parameter_count
    from tests.e2e.conftest import make_generator, close_generator
    from tests.e2e.test_kimi_k25 import _batch

    if __name__ == "__main__":
        generator = make_generator(sys.argv[1], 1, trust_remote_code=True)
        towers = generator.executor.collective_rpc(tower_parameter_count)
        results = generator.generate(_batch())
        close_generator(generator)
        torch.save(results, sys.argv[2])
        print(json.dumps({"towers": towers}))
    """
)


# `extended` (make test-extended): an escape hatch that builds the whole model;
# the switch itself is the registry's SPECSHIM_DISABLE, unit-tested.
@pytest.mark.extended
def test_text_only_loading_can_be_disabled(tiny_model_dir, tmp_path):
    import torch

    script = tmp_path / "disabled.py"
    script.write_text(_DISABLED)
    out = tmp_path / "states.pt"
    env = dict(os.environ, SPECSHIM_DISABLE="text-only-loading")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, str(script), str(tiny_model_dir("kimi_k25")), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    towers = json.loads(done.stdout.strip().splitlines()[-1])["towers"]
    assert towers[0] > 0, "with the patch disabled the tower should be built"
    _, deepseek = _run(str(tiny_model_dir("deepseek_v3")), 1)
    _assert_identical(torch.load(out), deepseek)


def test_kimi_k25_code_runs_only_with_consent(tiny_model_dir, tmp_path, monkeypatch):
    """The fixture ships configuration_kimi_k25.py (and an image processor):
    refused, before anything loads, by the generator and by every command."""
    import specshim

    path = str(tiny_model_dir("kimi_k25"))
    monkeypatch.delenv("SPECSHIM_TRUST_REMOTE_CODE", raising=False)
    specshim.configure(trust_remote_code=False)
    from speculators.data_generation import VllmHiddenStatesGenerator

    with pytest.raises(specshim.SpecShimError, match=r"configuration_kimi_k25\.py"):
        VllmHiddenStatesGenerator(path, layer_ids=LAYERS, max_model_len=256)
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    for argv in (
        ["extract", "--model", path, "--data", str(data), "--out", str(tmp_path / "o")],
        ["verify", "--model", path, "--out", str(tmp_path / "o")],
        ["doctor", "--model", path],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "specshim", *argv],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 2, (argv, done.stderr[-2000:])
        assert "configuration_kimi_k25.py (from config.json)" in done.stderr
        assert "--trust-remote-code" in done.stderr
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "o").exists()


def test_doctor_shows_text_only_loading_for_kimi(tiny_model_dir):
    done = subprocess.run(
        [sys.executable, "-m", "specshim", "doctor", "--json", "--trust-remote-code"]
        + ["--model", str(tiny_model_dir("kimi_k25"))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(done.stdout)
    states = {p["id"]: p["state"] for p in data["patches"]}
    assert states["text-only-loading"] == "applied"
    model = data["model"]
    assert model["architecture"] == "KimiK25ForConditionalGeneration"
    assert model["modalities"] == ["vision_chunk"]
    assert model["limits"] == {"vision_chunk": 0} and model["text_only"]
    assert model["decoder_layers"] == 6 and LAYERS[-1] < 6
