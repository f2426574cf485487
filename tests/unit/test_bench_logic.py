"""The benchmark's bookkeeping: how it picks extract's defaults and judges rows."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    """Imports benchmarks/ modules the way the benchmark's scripts do."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(BENCHMARKS))
        for name in ("judge", "plan", "render"):
            sys.modules.pop(name, None)


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
