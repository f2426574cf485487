"""The benchmark's bookkeeping: how it picks extract's defaults and judges rows."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def judge(bench):
    return bench("judge")


@pytest.fixture(scope="module")
def render(bench):
    return bench("render")


GOOD = {
    "missing_rows": [],
    "min_layer_mean": 0.999,
    "tokens_under_0_95": 0,
    "tokens": 1000,
}


def _point(seqs, tokens, fraction, batch, rate, agreement=GOOD, in_order=True):
    return {
        "max_num_seqs": seqs,
        "max_batched_tokens": tokens,
        "cache_memory_fraction": fraction,
        "batch_size": batch,
        "tokens_per_s": rate,
        "agreement": agreement,
        "in_order": in_order,
    }


def test_defaults_are_the_most_frugal_point_within_noise_of_the_fastest(judge):
    points = [
        _point(32, 8192, 0.2, 32, 1000),
        _point(256, 131072, 0.5, 256, 1300),  # fastest, but the most memory
        _point(256, 65536, 0.2, 256, 1290),  # within 3%: less KV cache
        _point(128, 32768, 0.2, 128, 1200),  # more than 3% slower
    ]
    assert judge.choose_extract_defaults(points) == (256, 65536, 0.2, 256)


def test_a_fast_point_that_disagrees_with_hf_or_reorders_rows_is_never_chosen(judge):
    wrong = dict(GOOD, min_layer_mean=0.5)
    points = [
        _point(32, 8192, 0.2, 32, 1000),
        _point(64, 16384, 0.2, 64, 5000, agreement=wrong),
        _point(128, 32768, 0.2, 128, 5000, in_order=False),
        _point(256, 65536, 0.2, 256, 5000, agreement=dict(GOOD, missing_rows=[3])),
    ]
    assert judge.choose_extract_defaults(points) == (32, 8192, 0.2, 32)


def test_agreement_bar_is_the_e2e_bar(judge):
    assert judge.agrees(GOOD)
    assert not judge.agrees(dict(GOOD, min_layer_mean=0.97))
    assert judge.agrees(dict(GOOD, tokens_under_0_95=100))
    assert not judge.agrees(dict(GOOD, tokens_under_0_95=101))
    assert not judge.agrees({"error": "row 3: shape (5, 256) vs (6, 256)"})
    assert not judge.agrees(None)
    measured = dict(GOOD, max_mean_norm_error=0.01, tokens_off_in_norm=0)
    assert judge.agrees(measured)
    # A constant factor keeps every cosine at 1 and still fails: states x 0.4.
    assert not judge.agrees(dict(measured, max_mean_norm_error=0.6))
    assert not judge.agrees(dict(measured, tokens_off_in_norm=101))


def test_extract_defaults_are_the_committed_benchmarks_choice():
    import json

    from specshim._settings import DEFAULT_BATCH_SIZE, STEP_DEFAULTS

    results = BENCHMARKS / "results" / "bench.json"
    seqs, tokens, fraction, batch = json.loads(results.read_text())["extract_defaults"]
    assert STEP_DEFAULTS == {
        "max_num_seqs": seqs,
        "max_batched_tokens": tokens,
        "cache_memory_fraction": fraction,
    }, "update specshim._settings.STEP_DEFAULTS from benchmarks/results/bench.json"
    assert DEFAULT_BATCH_SIZE == batch


def test_labels_come_from_the_data_and_leave_the_defaults_alone(render):
    data = {"labels": {"specshim-tuned": "specshim, tuned"}}
    assert render.labels(data)["specshim-tuned"] == "specshim, tuned"
    assert render.labels(data)["hf"] == render.LABELS["hf"]
    assert "specshim-tuned" not in render.labels({})
    assert "specshim-tuned" not in render.LABELS


def test_performance_page_block_is_the_committed_results_table(render):
    import json

    data = json.loads((BENCHMARKS / "results" / "bench.json").read_text())
    page = BENCHMARKS.parent / "docs" / "performance.md"
    assert render.RESULTS_BLOCK.read(page.read_text()) == render.results_block(
        data, page
    )


def test_bench_gpu_counts_the_peer_at_its_best_and_judges_the_targets(bench):
    """The faster of the peer's two settings counts; each target applies to
    its models; the table and its notes say which setting and what binds."""
    summary_module = bench("gpu_summary")
    tokens = 1_000_000
    parts = {
        "prefill@default": {"seconds": 4.0, "passes": [4.2, 4.0], "settings": {}},
        "prefill@0.8": {"seconds": 5.0, "passes": [5.0, 5.1], "settings": {}},
        "native@default": {"seconds": 5.0, "passes": [5.0, 5.0]},
        "native@0.8": {"seconds": 4.5, "passes": [4.5, 4.6]},
        "generate": {"seconds": 4.6, "passes": [4.6, 4.7]},
        "extract": {
            "seconds": 5.0,
            "passes": [5.3, 5.0],
            "timing": {
                "total": 5.0,
                "generate": 4.5,
                "handing": 0.4,
                "writer_idle": 0.1,
                "threads": 8.0,
                "writer_serializing": 4.8,
                "writer_committing": 0.1,
            },
        },
        "disk": {"nofsync_bytes_per_s": 3e9, "fsync_bytes_per_s": 1e9},
    }
    s = summary_module.summarise("llama-1b", parts, tokens)
    assert (s["prefill"], s["prefill_utilization"]) == (250_000, "default")
    assert (s["native"], s["native_utilization"]) == (222_222, "0.8")
    assert s["extract_vs_native"] == 0.9 and s["generate_vs_prefill"] == 0.8696
    assert s["targets"] == {
        "generate >= 0.85 x prefill": True,
        "extract >= 0.9 x generate": True,
        "extract >= 0.85 x native": True,
        "stretch: extract >= native": False,
    }
    mla = summary_module.summarise(
        "kimi-mla", {k: v for k, v in parts.items() if "native" not in k}, tokens
    )
    assert "extract >= 0.8 x prefill" in mla["targets"]
    assert not any("native" in k for k in mla["targets"])
    text = summary_module.render({"llama-1b": s, "kimi-mla": mla})
    assert "| llama-1b | 250,000 | 222,222 | 217,391 | 200,000 | 0.9 |" in text
    assert "prefill: default, native: 0.8" in text
    assert "stretch: extract >= native: missed" in text
    assert "generate() took 4.5 s" in text
    assert "extract the best of 2 runs, each a process of its own" in text


def test_extracts_gpu_step_budget_is_bench_gpus_choice():
    """GPU_STEP_DEFAULTS' budget ran extract within 3% of the fastest budget
    measured, on every model of the committed bench-gpu results."""
    import json

    from specshim._settings import GPU_STEP_DEFAULTS

    results = json.loads((BENCHMARKS / "results" / "gpu.json").read_text())
    chosen = GPU_STEP_DEFAULTS["max_batched_tokens"]
    judged = 0
    for model, summary in results.items():
        rates = {
            k: v for k, v in summary["tok_per_s"].items() if k.startswith("extract")
        }
        if len(rates) < 2:
            continue
        at_default = rates.get(f"extract@{chosen}", rates["extract"])
        assert at_default >= 0.97 * max(rates.values()), (model, rates)
        judged += 1
    assert judged >= 2, "bench-gpu measured no step budgets to choose from"


def test_bench_gpus_generate_runs_at_extracts_step_budget(bench):
    """extract ÷ generate compares one step budget: bare generate() takes the
    budget extract takes on a GPU, unless --budget names another."""
    import argparse

    from specshim._settings import GPU_STEP_DEFAULTS

    parts = bench("gpu_parts")
    chosen = GPU_STEP_DEFAULTS["max_batched_tokens"]
    assert parts.generate_budget(argparse.Namespace(budget=0)) == chosen
    assert parts.generate_budget(argparse.Namespace(budget=8192)) == 8192


def test_bench_gpus_generate_puts_its_budget_in_force_after_import_specshim(bench):
    """specshim is imported before part_generate picks its budget, so a
    SPECSHIM_* variable set then is never read: the budget must reach
    speculators' module all the same (it once ran every call at 8,192)."""
    import argparse
    import importlib

    import specshim

    parts = bench("gpu_parts")
    module = importlib.import_module(
        "speculators.data_generation.vllm_hidden_states_generator"
    )
    try:
        for budget in (12_288, 0):
            chosen = parts.set_generate_budget(argparse.Namespace(budget=budget))
            assert (
                module.MIN_MAX_BATCHED_TOKENS
                == chosen
                == parts.generate_budget(argparse.Namespace(budget=budget))
            )
    finally:
        specshim.configure(reset=True)
    assert module.MIN_MAX_BATCHED_TOKENS == 8192


def test_bench_gpu_says_extracts_rate_at_each_writer_pool_size(bench):
    """--writer-threads runs extract again with SPECSHIM_WRITER_THREADS at each
    size: the table keeps extract's own run, a note lists the others."""
    summary_module = bench("gpu_summary")
    parts = {
        "prefill@default": {"seconds": 4.0, "passes": [4.0, 4.1], "settings": {}},
        "generate": {"seconds": 5.0},
        "extract": {"seconds": 10.0},
        "extract@t1": {"seconds": 8.0},
        "extract@t4": {"seconds": 12.5},
    }
    s = summary_module.summarise("kimi-width", parts, 1_000_000)
    assert s["extract_vs_generate"] == 0.5  # extract's own run, not a variant
    text = summary_module.render({"kimi-width": s})
    assert (
        "kimi-width: extract with its writer's threads at 1: 125,000, 4: 80,000 "
        "tok/s (at its own choice: 100,000)." in text
    )


def test_bench_gpu_says_generate_and_extracts_rate_at_each_call_size(bench):
    """--batch-sizes runs generate and extract again with more sequences a
    call: the table keeps the runs at 32, a note lists the others, and the
    step-budget note does not mistake a call size for a budget."""
    import argparse

    summary_module = bench("gpu_summary")
    parts = {
        "prefill@default": {"seconds": 4.0, "passes": [4.0, 4.1], "settings": {}},
        "generate": {"seconds": 5.0},
        "generate@b128": {"seconds": 4.0},
        "extract": {"seconds": 10.0},
        "extract@b64": {"seconds": 8.0},
        "extract@b128": {"seconds": 5.0},
    }
    s = summary_module.summarise("llama-1b", parts, 1_000_000)
    assert s["generate_vs_prefill"] == 0.8 and s["extract_vs_generate"] == 0.5
    text = summary_module.render({"llama-1b": s})
    assert (
        "llama-1b: generate at 128: 250,000 tok/s by sequences a call (at 32: "
        "200,000)." in text
    )
    assert "extract at 64: 125,000, 128: 200,000 tok/s" in text
    assert "tokens a step (extract" not in text
    size = bench("gpu_parts").batch_size
    assert size(argparse.Namespace(batch=0)) == 32
    assert size(argparse.Namespace(batch=128)) == 128


def test_bench_gpus_layer_count_is_what_transformers_builds(bench):
    """kimi-width is as deep as one GPU holds: the parameter count behind
    ``fitting_layers`` is the one transformers builds, layer for layer."""
    import torch
    import transformers

    from specshim.job.inputs.tiny_checkpoints import COMMON, deepseek_v3_config

    models = bench("gpu_models")
    _, overrides, _ = models.MODELS["kimi-width"]
    small = {
        **overrides,
        "hidden_size": 256,
        "intermediate_size": 320,
        "moe_intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 48,
        "kv_lora_rank": 40,
        "qk_nope_head_dim": 24,
        "qk_rope_head_dim": 16,
        "v_head_dim": 20,
        "n_routed_experts": 6,
    }
    dense, moe, embeddings = models.layer_parameters(small)
    for layers in (1, 3):
        config = transformers.DeepseekV3Config(
            **deepseek_v3_config(
                **{**COMMON, "vocab_size": models.VOCAB, **small}
                | {"num_hidden_layers": layers}
            )
        )
        with torch.device("meta"):
            model = transformers.DeepseekV3ForCausalLM(config)
        built = sum(p.numel() for p in model.parameters())
        assert built == embeddings + dense + (layers - 1) * moe, layers
    # one H200 (139.8 GiB) at extract's 0.8: 18 of Kimi-width's layers
    assert models.fitting_layers(overrides, 150_119_792_640) == 18
    assert models.fitting_layers(overrides, 24 << 30) == 1  # only the dense one


def test_the_devices_busy_time_counts_each_kernel_once():
    """An operator's event carries its kernels' device time too: the busy time
    sums the device's own events only (the H200's first profile said 0.82 s
    busy in 0.59 s of wall time, torch's own total 0.41 s)."""
    import types

    from torch.autograd import DeviceType

    from specshim.testing.worker_probes import device_busy

    def event(key, kind, spent, annotation=False):
        return types.SimpleNamespace(
            key=key,
            device_type=kind,
            self_device_time_total=spent,
            is_user_annotation=annotation,
        )

    events = [
        event("aten::mm", DeviceType.CPU, 290.0),
        event("nvjet_sm90_tst", DeviceType.CUDA, 290.0),
        event("aten::copy_", DeviceType.CPU, 26.0),
        event("Memcpy DtoH (Device -> Pinned)", DeviceType.CUDA, 26.0),
        event("execute_model", DeviceType.CUDA, 500.0, annotation=True),
    ]
    assert device_busy(events) == (316.0, {"Memcpy DtoH (Device -> Pinned)": 26.0})


def test_the_worker_profile_says_how_busy_the_device_was(bench):
    """--worker-profile: torch's profiler in the worker (here: this process,
    on the CPU), summed into the device's busy time and copies, and said in
    gpu.md's notes."""
    import types

    import torch

    from specshim.testing.worker_probes import profile_start, profile_stop

    worker = types.SimpleNamespace()
    profile_start(worker)
    torch.ones(64, 64) @ torch.ones(64, 64)
    found = profile_stop(worker)
    assert "aten::mm" in found["table"] and not hasattr(worker, "_specshim_profiler")
    assert found["device_us"] == 0 and found["copies_us"] == {}  # no GPU here
    summary_module = bench("gpu_summary")
    parts = {
        "prefill@default": {"seconds": 4.0, "passes": [4.0], "settings": {}},
        "generate": {
            "seconds": 5.0,
            "worker_profile": {
                "calls": 4,
                "wall_s": 0.6,
                "device_us": 480_000,
                "copies_us": {"Memcpy DtoH (Device -> Pinned)": 30_000},
            },
        },
    }
    text = summary_module.render(
        {"llama-1b": summary_module.summarise("llama-1b", parts, 1_000_000)}
    )
    assert (
        "llama-1b: 4 generate() calls under the worker's profiler took 0.6 s; "
        "the GPU was busy 0.480 s, of it copies: Memcpy DtoH (Device -> Pinned) "
        "0.030 s." in text
    )


def test_bench_gpus_run_names_are_the_ones_its_summary_reads(bench):
    """One name per run for the results and the logs: the summary splits a
    step budget from a pool size by the ``t``."""
    parts = bench("gpu_parts")
    assert parts.label("prefill", util="default") == "prefill@default"
    assert parts.label("extract", budget=32768) == "extract@32768"
    assert parts.label("extract", budget=0, threads=4) == "extract@t4"
    assert parts.label("extract", budget=0, threads=0) == "extract"
    assert parts.label("generate", batch=128) == "generate@b128"
    assert parts.label("extract", budget=0, threads=0, batch=0) == "extract"
