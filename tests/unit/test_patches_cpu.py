"""The CPU patches: cpu_kv_cache_space, cpu_mla_disable and cpu_amx_tiles."""

from __future__ import annotations

import os

import pytest
import torch

from specshim._types import Incompatible, NotNeeded
from specshim.patches.main import cpu_kv_cache_space
from specshim.patches.worker import cpu_amx_tiles


def test_cpu_torch_view_reports_kv_space_and_forwards_the_rest(monkeypatch):
    monkeypatch.setattr(cpu_kv_cache_space, "_cpu_kv_cache_space", lambda: 3 << 30)
    view = cpu_kv_cache_space.PATCH.build(torch)
    assert view.cuda.mem_get_info() == (3 << 30, 3 << 30)
    view.cuda.empty_cache()
    assert view.as_tensor([1]).dtype == torch.long
    assert isinstance(torch.zeros(1), view.Tensor)


def test_cpu_kv_space_is_the_variable_whatever_the_platform_reports(monkeypatch):
    """vLLM 0.20's platform reports the machine's memory even with the variable
    set; speculators must still get the space the user set aside."""
    from vllm.platforms.cpu import CpuPlatform

    monkeypatch.setattr(CpuPlatform, "get_device_total_memory", lambda: 64 << 30)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert cpu_kv_cache_space._cpu_kv_cache_space() == 3 << 30
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    assert cpu_kv_cache_space._cpu_kv_cache_space() == 64 << 30


def test_cpu_mla_runs_only_where_vllm_can_prefill_this_width(tmp_path, monkeypatch):
    import importlib.util
    import json

    from specshim.patches.main import cpu_mla_disable

    def checkpoint(name, config):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        return tmp_path / name

    wide = checkpoint("wide", {"kv_lora_rank": 512, "qk_rope_head_dim": 64})
    narrow = checkpoint("narrow", {"kv_lora_rank": 32, "qk_rope_head_dim": 32})
    kimi = checkpoint(
        "kimi", {"text_config": {"kv_lora_rank": 512, "qk_rope_head_dim": 64}}
    )
    llama = checkpoint("llama", {"model_type": "llama"})
    # This vLLM (0.16) has no CPU MLA: off for every model.
    assert cpu_mla_disable.cpu_mla_runs(wide) == (
        False,
        "no MLA backend for CPU (vLLM < 0.28)",
    )
    real = importlib.util.find_spec
    present = {"vllm.v1.attention.backends.mla.cpu_mla"}

    def find_spec(name, *args):
        return object() if name in present else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert (
        cpu_mla_disable.cpu_mla_runs(wide)[1] == "no CPU prefill for MLA (vLLM < 0.29)"
    )
    present.add("vllm.v1.attention.backends.mla.prefill.cpu_sdpa")
    assert cpu_mla_disable.cpu_mla_runs(wide)[0] is True
    assert cpu_mla_disable.cpu_mla_runs(kimi)[0] is True
    assert cpu_mla_disable.cpu_mla_runs(narrow) == (
        False,
        "MLA width 64; vLLM's CPU MLA takes 576",
    )
    assert cpu_mla_disable.cpu_mla_runs(llama)[0] is False
    assert cpu_mla_disable.cpu_mla_runs(tmp_path / "missing")[0] is False

    # Decided again for each generator; a value the user set is left alone.
    # setenv first: monkeypatch records the value before the test (delenv of
    # an unset name records nothing), so what _before sets is undone after it.
    monkeypatch.setenv("VLLM_MLA_DISABLE", "")
    monkeypatch.delenv("VLLM_MLA_DISABLE")
    monkeypatch.setattr(cpu_mla_disable, "_ours", [])
    cpu_mla_disable._before((None,), {"model_path": str(wide)})
    assert os.environ["VLLM_MLA_DISABLE"] == "0"
    cpu_mla_disable._before((None,), {"model_path": str(narrow)})
    assert os.environ["VLLM_MLA_DISABLE"] == "1"
    cpu_mla_disable._before((None,), {"model_path": str(wide)})
    assert os.environ["VLLM_MLA_DISABLE"] == "0"
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")  # the user's
    cpu_mla_disable._before((None,), {"model_path": str(wide)})
    assert os.environ["VLLM_MLA_DISABLE"] == "1"


def test_a_worker_asks_for_the_amx_tiles_before_its_capture_is_set_up(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: calls.append("amx") or True)

    def setup(self, layer_ids):
        calls.append(("setup", layer_ids))

    cpu_amx_tiles.PATCH.build(setup)(object(), [1, 2])
    assert calls == ["amx", ("setup", [1, 2])]


def test_a_cpu_without_amx_asks_for_nothing(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: pytest.fail("asked"))
    assert cpu_amx_tiles.ask_for_amx() is False


@pytest.mark.skipif(
    not torch.cpu._is_amx_tile_supported(), reason="this CPU has no AMX tiles"
)
def test_linux_grants_the_amx_tiles_on_a_cpu_that_has_them():
    assert cpu_amx_tiles.ask_for_amx() is True


def test_the_amx_request_applies_only_where_speculators_blocks_reach_amx(
    monkeypatch,
):
    """Where the CPU attention runs speculators' 16-token blocks (vector
    kernels, vLLM before 0.29), nothing needs the tiles; where it does not
    (the platform's 128, whose bfloat16 path is AMX), the probe accepts, and
    a torch without ``_init_amx`` is refused rather than left to SIGILL."""

    def setup(self, layer_ids):
        return None

    from specshim.patches.main import cpu_block_size

    monkeypatch.setattr(cpu_block_size, "cpu_attention_accepts", lambda size: True)
    with pytest.raises(NotNeeded, match="16-token blocks"):
        cpu_amx_tiles.PATCH.probe(setup)
    monkeypatch.setattr(cpu_block_size, "cpu_attention_accepts", lambda size: False)
    cpu_amx_tiles.PATCH.probe(setup)
    monkeypatch.delattr(torch.cpu, "_init_amx")
    with pytest.raises(Incompatible, match="_init_amx"):
        cpu_amx_tiles.PATCH.probe(setup)


def test_the_amx_request_is_the_outermost_wrapper_of_its_target():
    """capture-hooks replaces the setup without calling what it wraps: a
    request stacked under it would never run (seen: the patch "applied", the
    worker still killed by SIGILL on vLLM 0.32.0)."""
    import specshim

    same = [
        patch.id
        for patch in specshim.registry()
        if patch.target == cpu_amx_tiles.PATCH.target
    ]
    assert "capture-hooks" in same and same[-1] == "cpu-amx-tiles", same
