"""Every way into specshim, on a GPU: the vLLM plugin and ``specshim run`` (a
script that never imports specshim), ``specshim extract`` (plain and
``--data-parallel 1``) then ``verify`` with both references, ``specshim
check``, and the capture contract's refusals."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specshim.job.extract.parallel import visible_gpus

from ..e2e.conftest import LAYERS, half_built, make_generator
from ..e2e.test_extract import _command, _run_ok
from ..e2e.test_extract_parallel import _assert_identical
from ..e2e.test_verify_references import (
    _assert_flags_exactly_the_tampered,
    _dataset,
    _tamper,
    _verify,
)

# A user's script: it never imports specshim and sets no variable. Its
# generator's rows are checked against HF in the same process.
SCRIPT = """
import json, random, sys

def main(model, route):
    if route == "plugin":  # what vLLM does in every process it starts
        from vllm.plugins import load_general_plugins
        load_general_plugins()
    from speculators.data_generation import VllmHiddenStatesGenerator
    from specshim.job.verify.hf_reference import HFReference, mismatch
    rng = random.Random(3)
    batch = [[rng.randrange(300) for _ in range(rng.randint(1, 90))] for _ in range(40)]
    gen = VllmHiddenStatesGenerator(model, layer_ids={layers}, max_model_len=1024)
    reference = HFReference(model)
    bad = []
    for call in range(3):  # more than max_num_seqs requests across calls
        for ids, out in zip(batch, gen.generate(batch)):
            why = mismatch(out["hidden_states"], reference.states(ids, {layers}))
            bad += [why] if why else []
    print("RESULT", json.dumps({{"sequences": 3 * len(batch), "bad": bad[:3]}}))
    gen.executor.shutdown()

if __name__ == "__main__":  # spawned workers import this file again
    main(sys.argv[1], sys.argv[2])
"""


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "user_script.py"
    path.write_text(textwrap.dedent(SCRIPT.format(layers=LAYERS)))
    return path


def _result(run: subprocess.CompletedProcess) -> dict:
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, run.stdout[-2000:] + run.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.mark.parametrize("route", ["plugin", "run"])
def test_a_script_that_never_imports_specshim(route, tmp_path, tiny_model_dir):
    model, script = str(tiny_model_dir("llama")), str(_script(tmp_path))
    cmd = [sys.executable, script, model, route]
    if route == "run":
        cmd = [sys.executable, "-m", "specshim", "run", "--", *cmd]
    result = _result(subprocess.run(cmd, capture_output=True, text=True, timeout=900))
    assert result == {"sequences": 120, "bad": []}


def test_extract_then_verify_with_hf_and_solo(tmp_path, tiny_model_dir):
    """extract, then ``extract --data-parallel 1``: one shard on the one GPU
    (CUDA_VISIBLE_DEVICES=<that GPU>, ``--shard 0/1``), the same batches,
    so its files, manifest and data_config.json must be bit-identical; then
    ``verify`` with both references, clean and after tampering."""
    model, data = tiny_model_dir("llama"), _dataset(tmp_path / "d.jsonl")
    out, one = tmp_path / "out", tmp_path / "one"
    _run_ok(_command(model, data, out))
    _run_ok(_command(model, data, one, "--data-parallel", "1"))
    _assert_identical(out, one)
    header = (one / ".specshim" / "shard-0-of-1.log").read_text().splitlines()[0]
    first = visible_gpus()[0]  # what a shard of one on a host of one is given
    assert header.startswith(f"# CUDA_VISIBLE_DEVICES={first} "), header
    clean = _verify(model, out, "hf")
    assert clean.returncode == 0, clean.stdout + clean.stderr[-2000:]
    _tamper(out)
    for reference in ("hf", "solo"):
        _assert_flags_exactly_the_tampered(_verify(model, out, reference), reference)


def test_check_passes_on_the_gpu():
    run = subprocess.run(
        [sys.executable, "-m", "specshim", "check"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    assert "worker-start-method" in run.stdout


def test_float16_deepseek_is_refused(tmp_path):
    from specshim.testing.tiny_models import MLA_WIDTH, build_deepseek_v3

    # DeepSeek-V3's own factor: float16 layers rescale the residual by 1/2.5.
    path = build_deepseek_v3(tmp_path / "fp16", routed_scaling_factor=2.5, **MLA_WIDTH)
    config = json.loads((path / "config.json").read_text())
    config.update(torch_dtype="float16", dtype="float16")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="run the model in bfloat16") as refused:
        make_generator(str(path), 1)
    _assert_closed(refused.value)


def test_compiled_graph_mode_is_refused(tiny_model_dir, monkeypatch):
    """A user who turns speculators' enforce_eager off gets compilation and
    CUDA graphs on a GPU; the workers refuse before anything is captured."""
    from speculators.data_generation import vllm_hidden_states_generator as module

    original = module.ModelConfig

    def compiled(*args, **kwargs):
        return original(*args, **{**kwargs, "enforce_eager": False})

    monkeypatch.setattr(module, "ModelConfig", compiled)
    with pytest.raises(Exception, match="eager execution") as refused:
        make_generator(str(tiny_model_dir("llama")), 1)
    _assert_closed(refused.value)


def _assert_closed(error: BaseException) -> None:
    """specshim shut down what the refused constructor had started, and its
    queues' contexts can be collected (on vLLM 0.24.0 a collection inside
    pytest's summary once waited on them forever)."""
    generator = half_built(error)
    assert generator is None or "executor" not in vars(generator)
    del generator
    gc.collect()
