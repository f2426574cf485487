"""The plan of shared prefixes (``job/extract/prefixes.py``): which samples
share full blocks, the order that runs them together, what each may take
from the cache and the host memory their rows hold."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from specshim.job.extract.prefixes import (
    chain,
    engine_block_hasher,
    plain_block_hasher,
    plan_prefixes,
)

B = 16  # block size


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def test_a_shared_system_prompt_is_computed_once():
    rng = random.Random(0)
    prompt = _tokens(rng, 64)
    samples = [(i, prompt + _tokens(rng, rng.randrange(20, 90))) for i in range(6)]
    plan = plan_prefixes(samples, B, bytes_per_token=10)
    first = plan.order[0]
    assert plan.reuse[first] == 0  # the first computes the prompt
    assert all(plan.reuse[i] == 64 for i in plan.order[1:])
    assert plan.reused_tokens == 5 * 64
    assert plan.peak_bytes == 4 * B * 10  # the prompt's four blocks, held
    assert set(plan.keep_until.values()) == {plan.order[-1]}


def test_duplicates_reuse_all_but_the_block_of_their_last_token():
    rng = random.Random(1)
    ids = _tokens(rng, 40)  # 2 full blocks, 8 tokens over
    plan = plan_prefixes([(0, ids), (1, list(ids))], B, bytes_per_token=1)
    assert plan.reuse == {0: 0, 1: 32}
    whole = _tokens(rng, 48)  # 3 full blocks: the last one holds the last token
    plan = plan_prefixes([(0, whole), (1, list(whole))], B, bytes_per_token=1)
    assert plan.reuse == {0: 0, 1: 32}


def test_a_sample_that_is_another_ones_prefix():
    rng = random.Random(2)
    short = _tokens(rng, 48)
    plan = plan_prefixes([(0, short + _tokens(rng, 20)), (1, short)], B, 1)
    # The short one runs first and computes its whole third block, which the
    # cache then serves to the long one; the other way round, only two blocks
    # (vLLM never serves the block of a prompt's last token).
    assert plan.order == (1, 0)
    assert plan.reuse == {1: 0, 0: 48}


def test_growing_multi_turn_prefixes_reuse_each_earlier_turn():
    rng = random.Random(3)
    turns = [_tokens(rng, 32) for _ in range(4)]
    convo = [sum(turns[: k + 1], []) + [7] for k in range(4)]  # cut at each turn
    order = [3, 0, 2, 1]
    plan = plan_prefixes([(i, convo[i]) for i in order], B, bytes_per_token=1)
    assert plan.order == (0, 1, 2, 3)  # the trie's order: shortest first
    assert [plan.reuse[i] for i in plan.order] == [0, 32, 64, 96]
    assert plan.peak_bytes == 6 * B  # blocks 1-6 wait for the next turn


def test_a_prefix_ending_mid_block_shares_its_full_blocks_only():
    rng = random.Random(4)
    prompt = _tokens(rng, 40)
    plan = plan_prefixes(
        [(i, prompt + _tokens(rng, 50)) for i in range(3)], B, bytes_per_token=1
    )
    assert sorted(plan.reuse.values()) == [0, 32, 32]


def test_no_sharing_keeps_the_dataset_order_and_reuses_nothing():
    rng = random.Random(5)
    samples = [(i, _tokens(rng, rng.randrange(1, 200))) for i in range(50)]
    plan = plan_prefixes(samples, B, bytes_per_token=1)
    assert plan.order == tuple(range(50))
    assert plan.reused_tokens == 0 and plan.peak_bytes == 0 and not plan.keep_until


def test_samples_sharing_a_prefix_run_next_to_each_other():
    rng = random.Random(6)
    prompts = [_tokens(rng, rng.choice([16, 40, 64])) for _ in range(8)]
    samples = [
        (i, rng.choice(prompts) + _tokens(rng, rng.randrange(1, 60)))
        for i in range(120)
    ]
    plan = plan_prefixes(samples, B, bytes_per_token=1)
    ids = dict(samples)
    # the first full block of every sample that shares it (its last token
    # outside it) with another, in the plan's order
    first = {i: tuple(ids[i][:B]) for i in ids if len(ids[i]) > B}
    held = Counter(first.values())
    firsts = [first[i] for i in plan.order if i in first and held[first[i]] > 1]
    runs = [k for n, k in enumerate(firsts) if n == 0 or firsts[n - 1] != k]
    assert len(runs) == len(set(runs)), "a shared first block ran in two places"
    # every sample after the first of its prompt reuses that prompt's blocks
    for prompt in prompts:
        users = [i for i in plan.order if ids[i][: len(prompt)] == prompt]
        full = len(prompt) // B * B
        assert all(plan.reuse[i] >= full for i in users[1:]), prompt


def test_a_cap_computes_whole_the_groups_over_it_and_names_them():
    rng = random.Random(7)
    big, small = _tokens(rng, 160), _tokens(rng, 32)
    samples = [(i, big + _tokens(rng, 30)) for i in range(3)]
    samples += [(i, small + _tokens(rng, 30)) for i in range(3, 6)]
    plan = plan_prefixes(samples, B, bytes_per_token=100)
    assert plan.peak_bytes == 10 * B * 100
    capped = plan_prefixes(samples, B, bytes_per_token=100, cap_bytes=5 * B * 100)
    assert capped.cut == (0, 1, 2)  # the 160-token prompt's group
    assert all(capped.reuse[i] == 0 for i in (0, 1, 2))
    assert sorted(capped.reuse[i] for i in (3, 4, 5)) == [0, 32, 32]
    assert capped.peak_bytes == 2 * B * 100 <= 5 * B * 100
    nothing = plan_prefixes(samples, B, bytes_per_token=100, cap_bytes=0)
    assert nothing.cut == tuple(range(6)) and nothing.reused_tokens == 0


def test_the_engines_block_hashing_finds_what_the_plain_one_finds():
    pytest.importorskip("vllm")
    rng = random.Random(8)
    prompt = _tokens(rng, 50)
    samples = [
        (i, prompt[: rng.randrange(20, 50)] + _tokens(rng, 30)) for i in range(20)
    ]
    engine = plan_prefixes(samples, B, 1, hasher=engine_block_hasher())
    plain = plan_prefixes(samples, B, 1, hasher=plain_block_hasher())
    assert engine.reuse == plain.reuse and engine.peak_bytes == plain.peak_bytes
    ids = prompt[:48]
    assert len(chain(ids, B, engine_block_hasher())) == 3
    assert chain(ids, B, engine_block_hasher()) == chain(ids, B, engine_block_hasher())


def test_a_sharded_run_says_that_it_plans_its_own_samples_only():
    from specshim.job.extract.reuse import shard_note

    assert shard_note((0, 1)) is None
    note = shard_note((2, 4))
    assert note is not None and "\n" not in note
    assert "within shard 2/4 only (samples i % 4 == 2)" in note
    assert "4 apart" in note
