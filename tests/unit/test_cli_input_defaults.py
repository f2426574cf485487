"""Values the CLI chooses when not told: distinct default layers and the CPU
KV-cache space."""

from __future__ import annotations

from pathlib import Path

import pytest

from ._cli_input_helpers import model_fixture  # noqa: F401 - the model fixture


def test_default_layers_are_distinct():
    from specshim.job.inputs.checkpoint import choose_layers

    assert choose_layers(None, 6) == [2, 3, 5]  # speculators would take 2, 3, 3, 5
    assert choose_layers(None, 32) == [2, 16, 29, 31]


def test_cpu_kv_space_follows_the_job_and_the_flag(monkeypatch, model):
    from specshim._base import UsageError
    from specshim.job.inputs.checkpoint import read_model
    from specshim.job.kv_cache import cpu_kv_space, kv_need

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    per_token = read_model(Path(model)).kv_bytes_per_token
    assert per_token is not None and per_token > 0
    need = kv_need(8192, 2048, per_token, 0.8, 0.5)
    assert cpu_kv_space(None, need) == (1, "the job's need")
    huge = kv_need(1 << 30, 2048, per_token, 0.8, 0.5)  # capped by the machine
    gib, _ = cpu_kv_space(None, huge)
    import os

    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 1 <= gib <= available // 2 // (1 << 30)
    with pytest.raises(UsageError, match="give --cpu-kv-space-gib"):
        cpu_kv_space(None, None)  # a config that does not say enough
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    assert cpu_kv_space(None, need) == (3, "VLLM_CPU_KVCACHE_SPACE")
    assert cpu_kv_space(2, need) == (2, "--cpu-kv-space-gib")
