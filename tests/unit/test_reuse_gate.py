"""``extract --reuse-prefixes`` turns vLLM's prefix cache on only where two
samples could share a block: where none share their first 16 tokens (vLLM's
smallest block), the cache stays off, as without the flag, and the run says
so."""

from __future__ import annotations

import logging
import os

from specshim.job.extract import command as _extract
from specshim.job.extract.prefixes import SMALLEST_BLOCK, may_share, plan_prefixes

from ._pipeline_helpers import FakeGenerator, _jsonl, _options


def test_may_share_is_false_only_where_no_first_block_is_shared():
    block = list(range(1, SMALLEST_BLOCK + 1))
    assert may_share([block + [7], block + [8]])
    assert may_share([block, block + [8]])  # a whole sample is another's block
    # one token short of a block in common, or too short to hold one
    assert not may_share([block[:-1] + [99, 5], block[:-1] + [98, 5]])
    assert not may_share([block[:-1], block[:-1]])
    assert not may_share([])
    # A smaller block can share what 16 cannot.
    assert may_share([block[:8] + [1], block[:8] + [2]], smallest_block=8)


def test_where_may_share_is_false_the_plan_reuses_nothing_at_any_larger_block():
    """The gate never keeps the cache off where the plan would reuse: at
    every block size vLLM chooses, a sample set may_share calls unshared
    plans no reused token."""
    import random

    rng = random.Random(5)
    stem = [rng.randrange(1, 500) for _ in range(SMALLEST_BLOCK - 1)]
    samples = [stem + [rng.randrange(1, 500) for _ in range(rng.randint(1, 300))]]
    samples += [[rng.randrange(1, 500) for _ in range(rng.randint(1, 300))]]
    samples += [list(stem) for _ in range(3)]
    assert not may_share(samples)
    for block in (16, 32, 64, 128):
        plan = plan_prefixes(enumerate(samples), block, bytes_per_token=1)
        assert plan.reused_tokens == 0, block


def test_extract_keeps_the_cache_off_where_nothing_can_be_shared(
    tmp_path, tiny_model_dir, monkeypatch, caplog
):
    started: list[str | None] = []
    planned: list[int] = []

    def make(plan):
        started.append(os.environ.get("SPECSHIM_REUSE_PREFIXES"))
        return FakeGenerator()

    def plan(todos, *_):
        planned.append(len(todos))
        return todos, None

    monkeypatch.setattr(_extract, "_make_generator", make)
    monkeypatch.setattr(_extract.reuse, "planned", plan)
    monkeypatch.delenv("SPECSHIM_REUSE_PREFIXES", raising=False)
    model = tiny_model_dir("llama")
    unshared = [{"input_ids": [n] + list(range(2, 40))} for n in range(1, 9)]
    data = _jsonl(tmp_path / "d.jsonl", unshared)
    with caplog.at_level(logging.INFO, logger="specshim"):
        done = _extract.extract(
            _options(model, data, tmp_path / "out", reuse_prefixes=True)
        )
    assert done["written"] == 8
    assert started == [None] and planned == []
    assert "no two samples share their first 16 tokens" in caplog.text
    assert "the prefix cache stays off" in caplog.text
    # The same samples but two sharing a first block: the cache is on and
    # the feed planned.
    shared = unshared + [{"input_ids": [1] + list(range(2, 40))}]
    data = _jsonl(tmp_path / "d2.jsonl", shared)
    _extract.extract(_options(model, data, tmp_path / "out2", reuse_prefixes=True))
    assert started == [None, "1"] and planned == [9]
