"""Upstream facts the patches rely on, checked against the installed vLLM.

The shipped tier (``specshim check`` / ``pytest --pyargs specshim.compat``)
checks every patch's probe against its declared history. This developer tier
checks the history itself: each fact below is present exactly from the release
given as ``since`` (``None``: in no release up to 0.16.0, only in a nightly),
independently of any probe. Run in every ``make test-matrix`` environment, it
is what corrected VLLM_DRIFT.md's "since" column.
"""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest

import specshim
from specshim.patches._wrappers import GENERATOR, WORKER, parameters, upstream

pytestmark = pytest.mark.contract


@pytest.fixture(scope="module", autouse=True)
def loaded():
    for name in (GENERATOR, WORKER):
        importlib.import_module(name)


def _gen(name):
    return upstream(getattr(importlib.import_module(GENERATOR), name))


def _vllm_release() -> tuple[int, ...]:
    from specshim._versions import installed_release

    return installed_release("vllm")[:2]


def _required(callable_, name):
    param = parameters(callable_).get(name)
    return param is not None and param.default is inspect.Parameter.empty


def _default(callable_, name):
    param = parameters(callable_).get(name)
    return None if param is None else param.default


def _deepseek_layer_takes_llama_4_scaling():
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2DecoderLayer

    return (
        "llama_4_scaling"
        in inspect.signature(DeepseekV2DecoderLayer.forward).parameters
    )


def _llama_lost_get_input_embeddings():
    from vllm.model_executor.models.llama import LlamaModel

    return hasattr(LlamaModel, "embed_input_ids") and not hasattr(
        LlamaModel, "get_input_embeddings"
    )


def _towers_skippable():
    from vllm.model_executor.models.interfaces import SupportsMultiModal

    return hasattr(SupportsMultiModal, "_mark_tower_model")


def _has_kimi_k25():
    return importlib.util.find_spec("vllm.model_executor.models.kimi_k25") is not None


def _deepseek_declares_eagle3():
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM
    from vllm.model_executor.models.interfaces import supports_eagle3

    return bool(supports_eagle3(DeepseekV2ForCausalLM))


def _cpu_memory_ignores_the_kv_space_variable():
    """vLLM 0.20: the CPU platform reports the machine's memory, not the
    VLLM_CPU_KVCACHE_SPACE it reported before."""
    import os

    from vllm.platforms.cpu import CpuPlatform

    saved = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    try:
        return CpuPlatform.get_device_total_memory() != 1 << 30
    finally:
        if saved is None:
            del os.environ["VLLM_CPU_KVCACHE_SPACE"]
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved


def _cpu_runner_on_the_v2_runner():
    try:
        return importlib.util.find_spec("vllm.v1.worker.cpu.model_runner") is not None
    except ModuleNotFoundError:  # no vllm.v1.worker.cpu package at all
        return False


def _warm_up_left_out_of_initialize_from_config():
    init = _gen("MultiprocExecutor").initialize_from_config
    return "compile_or_warm_up_model" not in inspect.getsource(init)


def _has_cpu_mla_backend():
    spec = "vllm.v1.attention.backends.mla.cpu_mla"
    try:
        return importlib.util.find_spec(spec) is not None
    except ModuleNotFoundError:  # no vllm.v1.attention.backends.mla package
        return False


def _cpu_mla_prefill_builds():
    """vLLM 0.28's MLA layers on CPU ask for the FlashAttention prefill, whose
    import is CUDA-only; 0.29 answers with a PyTorch SDPA prefill. specshim's
    cpu_mla_missing() must agree with what vLLM really does."""
    from specshim.patches.main.cpu_mla_disable import cpu_mla_missing

    try:
        selector = importlib.import_module("vllm.v1.attention.backends.mla.prefill")
    except ImportError:
        built = False
    else:
        try:
            built = "cpu" in selector.get_mla_prefill_backend(None).__module__
        except ImportError:
            built = False
    assert built == (cpu_mla_missing() is None), cpu_mla_missing()
    return built


def _kv_cache_layout_resolved_by_the_engine():
    utils = importlib.import_module("vllm.v1.attention.backends.utils")
    return hasattr(utils, "resolve_kv_cache_layout")


def _cpu_attention_refuses_16_token_blocks():
    from specshim.patches.main.cpu_block_size import cpu_attention_accepts

    return cpu_attention_accepts(16) is False


def _sequence_parallel_pass_gone():
    from specshim.patches.worker.capture_contract import _sequence_parallel_passes

    return not _sequence_parallel_passes()


# (drift row, fact, since, check)
FACTS = [
    (
        1,
        "SchedulerConfig requires is_encoder_decoder",
        (0, 12),
        lambda: _required(_gen("SchedulerConfig"), "is_encoder_decoder"),
    ),
    (
        2,
        "chunked prefill on by default",
        (0, 12),
        lambda: _default(_gen("SchedulerConfig"), "enable_chunked_prefill") is True,
    ),
    (
        3,
        "prefix caching on by default",
        (0, 12),
        lambda: _default(_gen("CacheConfig"), "enable_prefix_caching") is True,
    ),
    (
        4,
        "get_kv_cache_config_from_groups lost kv_cache_specs",
        (0, 12),
        lambda: (
            "kv_cache_specs" not in parameters(_gen("get_kv_cache_config_from_groups"))
        ),
    ),
    (
        5,
        "Scheduler takes block_size",
        (0, 12),
        lambda: "block_size" in parameters(_gen("Scheduler")),
    ),
    (
        6,
        "Request takes block_hasher",
        (0, 11),
        lambda: "block_hasher" in parameters(_gen("Request")),
    ),
    (
        15,
        "Request lost eos_token_id",
        (0, 17),
        lambda: "eos_token_id" not in parameters(_gen("Request")),
    ),
    (16, "DeepSeek declares SupportsEagle3", (0, 18), _deepseek_declares_eagle3),
    (
        17,
        "Scheduler takes hash_block_size",
        (0, 20),
        lambda: "hash_block_size" in parameters(_gen("Scheduler")),
    ),
    (
        17,
        "EngineCore resolves block sizes with resolve_kv_cache_block_sizes",
        (0, 20),
        lambda: hasattr(
            importlib.import_module("vllm.v1.core.kv_cache_utils"),
            "resolve_kv_cache_block_sizes",
        ),
    ),
    (
        22,
        "ModelConfig takes language_model_only",
        (0, 17),
        lambda: "language_model_only" in parameters(_gen("ModelConfig")),
    ),
    (
        0,
        "CPU platform memory ignores VLLM_CPU_KVCACHE_SPACE",
        (0, 20),
        _cpu_memory_ignores_the_kv_space_variable,
    ),
    (
        18,
        "a CPU model runner built on the V2 runner",
        (0, 23),
        _cpu_runner_on_the_v2_runner,
    ),
    (
        7,
        "executor has sample_tokens",
        (0, 12),
        lambda: hasattr(_gen("MultiprocExecutor"), "sample_tokens"),
    ),
    (
        10,
        "SchedulerConfig resolves async_scheduling itself",
        (0, 14),
        lambda: _default(_gen("SchedulerConfig"), "async_scheduling") is None,
    ),
    (
        13,
        "LlamaModel has embed_input_ids, not get_input_embeddings",
        (0, 12),
        _llama_lost_get_input_embeddings,
    ),
    (
        14,
        "DeepseekV2DecoderLayer takes llama_4_scaling",
        (0, 12),
        _deepseek_layer_takes_llama_4_scaling,
    ),
    (12, "Kimi-K2.5 model exists", (0, 15), _has_kimi_k25),
    (
        0,
        "encoder towers skipped when their modalities are limited to 0",
        (0, 15),
        _towers_skippable,
    ),
    (
        20,
        "initialize_from_config no longer warms the workers up",
        (0, 27),
        _warm_up_left_out_of_initialize_from_config,
    ),
    (21, "a CPU MLA backend", (0, 28), _has_cpu_mla_backend),
    (21, "a CPU prefill for MLA", (0, 29), _cpu_mla_prefill_builds),
    (
        24,
        "the engine resolves one KV cache layout",
        (0, 29),
        _kv_cache_layout_resolved_by_the_engine,
    ),
    (
        26,
        "CPU attention kernels refuse 16-token blocks",
        (0, 29),
        _cpu_attention_refuses_16_token_blocks,
    ),
    (25, "no sequence-parallelism pass", (0, 32), _sequence_parallel_pass_gone),
]


@pytest.mark.parametrize(
    "row, fact, since, check", FACTS, ids=[fact for _, fact, _, _ in FACTS]
)
def test_upstream_fact_appears_where_the_history_says(row, fact, since, check):
    present = bool(check())
    expected = since is not None and _vllm_release() >= since
    where = "from " + ".".join(map(str, since)) if since else "in no release"
    assert present == expected, (
        f"drift row {row}: '{fact}' is {'present' if present else 'absent'} in "
        f"vLLM {_vllm_release()}, but the history says {where}"
    )


def _specshim(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specshim", *args],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )


def test_doctor_lists_every_patch():
    out = _specshim("doctor")
    assert out.returncode == 0, out.stdout + out.stderr
    for record in specshim.records():
        assert record.patch.id in out.stdout
    assert "entry point installed" in out.stdout


def test_doctor_fails_when_vllm_plugins_leaves_specshim_out():
    import os

    out = _specshim("doctor", env=dict(os.environ, VLLM_PLUGINS="some_other_plugin"))
    assert out.returncode == 1, out.stdout
    assert "filters specshim out" in out.stdout


def test_check_command_passes_and_names_every_patch():
    out = _specshim("check")
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    for record in specshim.records():
        assert f"patch {record.patch.id}" in out.stdout


def test_speculators_imports_by_every_route_and_needs_the_patch_where_applied():
    """transformers-torch-annotation must take effect before speculators is
    imported, whichever way specshim arrives: the vLLM plugin (how workers get
    it) and ``specshim run`` (sitecustomize) as well as ``import specshim``,
    which this whole tier runs under. Without specshim, the import must fail
    with transformers' unresolvable ``torch`` exactly where the patch applied."""
    import os

    from specshim._types import State

    (record,) = [
        r for r in specshim.records() if r.patch.id == "transformers-torch-annotation"
    ]
    applied = record.state is State.APPLIED
    code = "import speculators.data_generation.custom_worker"
    plugin = "from vllm.plugins import load_general_plugins; load_general_plugins(); "
    routes = {
        "without specshim": [sys.executable, "-c", code],
        "vLLM plugin": [sys.executable, "-c", plugin + code],
        "specshim run": [sys.executable, "-m", "specshim", "run", "--"]
        + [sys.executable, "-c", code],
    }
    env = {k: v for k, v in os.environ.items() if k != "SPECSHIM_DISABLE"}
    started = {
        route: subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        for route, cmd in routes.items()
    }
    done = {
        route: (p.communicate(timeout=300)[0], p.returncode)
        for route, p in started.items()
    }
    for route in ("vLLM plugin", "specshim run"):
        output, rc = done[route]
        assert rc == 0, f"{route}: {output[-2000:]}"
    output, rc = done["without specshim"]
    if applied:
        assert rc != 0 and "name 'torch' is not defined" in output, output[-2000:]
    else:
        assert rc == 0, f"not applied ({record.detail}), yet: {output[-2000:]}"
