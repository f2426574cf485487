"""``specshim verify`` with each reference: good samples pass, and a one-row
shift, two swapped samples and a sample of the wrong layer are flagged."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .test_extract import _command, _run_ok

pytestmark = pytest.mark.e2e


def _dataset(path: Path) -> Path:
    rng = random.Random(12)
    lengths = [23, 41, 57, 57, 36, 64]  # samples 2 and 3: same length
    lines = [{"input_ids": [rng.randrange(300) for _ in range(n)]} for n in lengths]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _tamper(out: Path) -> None:
    """Sample 1 shifted by a row, 2 and 3 swapped, 4 stored at the wrong layer."""

    def edit(index: int, change) -> None:
        path = out / f"data_{index}.pt"
        data = torch.load(path, weights_only=True)
        data["hidden_states"] = change(data["hidden_states"])
        torch.save(data, path)

    edit(1, lambda hs: [h.roll(1, dims=0) for h in hs])
    two = torch.load(out / "data_2.pt", weights_only=True)["hidden_states"]
    three = torch.load(out / "data_3.pt", weights_only=True)["hidden_states"]
    edit(2, lambda hs: three)
    edit(3, lambda hs: two)
    edit(4, lambda hs: [hs[0], hs[2], hs[2]])  # layer 5's states where 3 belongs


def _verify(model: Path, out: Path, reference: str, *extra: str):
    cmd = [sys.executable, "-m", "specshim", "verify", "--model", str(model)]
    cmd += ["--out", str(out), "--samples", "6", "--reference", reference, *extra]
    env = dict(os.environ)
    if "--tp" in extra:  # vLLM's CPU backend: one core per TP worker
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)


# DeepSeek-V3 (MoE) is `extended` (make test-extended): the references are the
# same code for both models, and make test checks each on Llama.
@pytest.fixture(
    scope="module",
    params=["llama", pytest.param("deepseek_v3", marks=pytest.mark.extended)],
)
def tampered(request, tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir(request.param)
    root = tmp_path_factory.mktemp(f"verify-{request.param}")
    out = root / "out"
    _run_ok(_command(model, _dataset(root / "d.jsonl"), out))
    _tamper(out)
    return request.param, model, out


def _assert_flags_exactly_the_tampered(run, reference: str) -> None:
    assert run.returncode == 1, run.stdout + run.stderr[-2000:]
    assert f"verify: reference {reference}" in run.stdout
    flagged = {
        int(line.split("data_")[1].split(".pt")[0])
        for line in run.stdout.splitlines()
        if line.strip().startswith("MISMATCH")
    }
    assert flagged == {1, 2, 3, 4}, run.stdout  # 0 and 5 are good and pass


@pytest.mark.parametrize("reference", ["hf", "solo"])
def test_each_reference_flags_shift_swap_and_wrong_layer(tampered, reference):
    _, model, out = tampered
    _assert_flags_exactly_the_tampered(_verify(model, out, reference), reference)


# `extended` (make test-extended): make test runs the solo reference at TP=1
# and the generator at TP=2 in the reference cases.
@pytest.mark.tp2
@pytest.mark.extended
def test_solo_reference_at_tp2(tampered):
    _, model, out = tampered
    run = _verify(model, out, "solo", "--tp", "2")
    assert "TP=2" in run.stdout
    _assert_flags_exactly_the_tampered(run, "solo")


def test_auto_takes_hf_when_the_bounded_model_fits(tampered):
    _, model, out = tampered
    run = _verify(model, out, "auto")
    assert "verify: reference hf (layers 0..5 fit" in run.stdout, run.stdout
