"""Unmodified speculators 0.3.0 on vLLM 0.16's CPU backend, checked per token
against a Hugging Face forward, for the batch shapes that break alignment.

Models: Llama, Qwen2, DeepSeek-V3 MoE and Kimi-K2.5 (a multimodal wrapper around
the same DeepSeek-V3 text weights), at TP=1 and TP=2."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
import torch

import specshim
from specshim._closing import worker_pids
from specshim.patches._transport.shared_states import MAX_SLABS
from specshim.testing.worker_probes import (
    early_fetches,
    pad_steps,
    sort_steps_by_token_count,
    tamper_captured_rows,
    use_transport,
)

from .checks import assert_batch_matches, mismatch
from .conftest import LAYERS, MAX_MODEL_LEN
from .ownership import (
    RING_BUFFER,
    SLAB_NAME,
    assert_callers_own,
    batch_of,
    reply_rows,
)

pytestmark = pytest.mark.e2e

VOCAB = 300  # stay inside the tiny tokenizer's real tokens


def _seqs(rng: random.Random, count: int, low: int, high: int) -> list[list[int]]:
    return [
        [rng.randrange(VOCAB) for _ in range(rng.randint(low, high))]
        for _ in range(count)
    ]


def _run(
    generator: Any, hf_reference: Any, tiny_model_dir: Any, batch: list[list[int]]
) -> None:
    results = generator.generate(batch)
    reference = hf_reference(tiny_model_dir(generator.specshim_reference_name))
    assert_batch_matches(results, batch, reference, LAYERS)


def test_shared_system_prompt(generator, hf_reference, tiny_model_dir):
    rng = random.Random(1)
    system = [rng.randrange(VOCAB) for _ in range(64)]  # four full KV blocks
    batch = [system + tail for tail in _seqs(rng, 8, 1, 40)]
    _run(generator, hf_reference, tiny_model_dir, batch)


def test_rows_in_the_runners_order_leave_as_they_were_captured(
    generator, hf_reference, tiny_model_dir
):
    """A batch in no order of length: the guard sends it shortest first, the
    order every runner computes it in, so the worker hands over the copies it
    made while the forward ran (early_copies) and copies nothing again; what
    the caller gets, in its own order, matches HF row by row."""
    rng = random.Random(47)
    batch = _seqs(rng, 9, 1, 120)
    batch = [*batch, batch[3]]  # and a duplicate
    before = generator.executor.collective_rpc(early_fetches)[0]
    _run(generator, hf_reference, tiny_model_dir, batch)
    after = generator.executor.collective_rpc(early_fetches)[0]
    if before is not None:  # None: no capture-hooks (vLLM 0.11), no early copies
        assert after - before == 1


def test_duplicate_prompts(generator, hf_reference, tiny_model_dir):
    rng = random.Random(2)
    prompt = [rng.randrange(VOCAB) for _ in range(50)]
    batch = [prompt, *_seqs(rng, 2, 5, 30), prompt, prompt, *_seqs(rng, 1, 40, 60)]
    _run(generator, hf_reference, tiny_model_dir, batch)


def test_batch_over_token_budget(generator, hf_reference, tiny_model_dir):
    # speculators' budget is max(8192, max_model_len) tokens a step; this batch
    # needs two steps, and the request that straddles the budget must not be
    # chunked (chunked prefill would cut it and speculators would abort it).
    rng = random.Random(3)
    batch = _seqs(rng, 12, 700, MAX_MODEL_LEN - 1)
    assert sum(map(len, batch)) > 8192
    _run(generator, hf_reference, tiny_model_dir, batch)


def test_more_sequences_than_max_num_seqs(generator, hf_reference, tiny_model_dir):
    rng = random.Random(4)
    batch = _seqs(rng, 70, 1, 24)  # speculators schedules at most 32 a step
    _run(generator, hf_reference, tiny_model_dir, batch)


def test_repeated_calls_with_different_batch_sizes(
    generator, hf_reference, tiny_model_dir
):
    rng = random.Random(5)
    for size in (1, 5, 3, 17, 2):
        _run(generator, hf_reference, tiny_model_dir, _seqs(rng, size, 1, 80))


def test_workers_free_every_finished_request(generator):
    """Each call's last step is never sent to the workers, so its requests'
    ids must reach them with the next call: vLLM's V2 GPU runner has only
    max_num_seqs request slots ("No free indices"), and the V1 runner would
    keep their state for good."""
    from specshim.testing.worker_probes import live_requests

    rng = random.Random(11)
    for _ in range(4):  # 20 sequences fit one step: all of them are its last
        generator.generate(_seqs(rng, 20, 1, 8))
    held = generator.executor.collective_rpc(live_requests)
    assert max(held) <= 20, f"workers still hold {held} finished requests"


def test_one_token_sequences(generator, hf_reference, tiny_model_dir):
    rng = random.Random(6)
    batch = [[7], [rng.randrange(VOCAB)], *_seqs(rng, 2, 2, 10), [7]]
    _run(generator, hf_reference, tiny_model_dir, batch)


def test_checks_reject_a_one_row_shift(generator, hf_reference, tiny_model_dir):
    """The comparison is strict enough to catch the failure it exists for."""
    rng = random.Random(7)
    batch = _seqs(rng, 3, 30, 60)
    results = generator.generate(batch)
    reference = hf_reference(tiny_model_dir(generator.specshim_reference_name))
    ids = batch[1]
    expected = reference.states(ids, LAYERS)
    assert mismatch(results[1]["hidden_states"], expected) is None
    import torch

    # The same number of rows, moved by one: what a partial prefill upstream
    # of this sequence would have produced.
    shifted = [
        torch.cat([results[0]["hidden_states"][k][-1:], h[:-1]])
        for k, h in enumerate(results[1]["hidden_states"])
    ]
    assert mismatch(shifted, expected) is not None
    # A constant factor (float16 DeepSeek layers capture the state x 0.4) keeps
    # every cosine at 1: the norm comparison must still fail it.
    scaled = [h * 0.4 for h in results[1]["hidden_states"]]
    assert mismatch(scaled, expected) is not None


def test_rows_laid_out_by_token_count_come_back_in_input_order(
    generator, hf_reference, tiny_model_dir, caplog
):
    """vLLM's V2 GPU runner sorts a step's requests by token count before the
    forward. Here the live V1 runner does the same in every worker (a test-only
    change), so rows leave the forward out of input order; the guard must put
    them back from their provenance alone."""
    rng = random.Random(8)
    batch = _seqs(rng, 9, 1, 120)
    assert sorted(batch, key=len, reverse=True) != batch
    generator.executor.collective_rpc(sort_steps_by_token_count)
    try:
        with caplog.at_level(logging.DEBUG, logger="specshim"):
            _run(generator, hf_reference, tiny_model_dir, batch)
    finally:
        generator.executor.collective_rpc(sort_steps_by_token_count, args=(False,))
    # The rows really left the forward reordered: the worker moved them into
    # input order (state-transport), and says so only at debug level.
    assert "into input order" in caplog.text
    assert not [
        r for r in caplog.records if r.name.startswith("specshim") and r.levelno >= 30
    ]


# Where both transports are compared bit for bit: a dense model at TP=1 and
# TP=2 and the MoE at TP=1 (the transport does not look at the model).
TRANSPORT_CASES = {("llama", 1), ("llama", 2), ("deepseek_v3", 1)}


def test_states_are_bit_identical_through_every_transport(generator, request):
    """What generate() returns through shared memory (with the worker's
    input-order layout, or copied out as each layer was captured) and through
    the fallback is, bit for bit, what the tensors pickled through vLLM's RPC
    queue gave, for a batch with a shared prefix, duplicates and rows that
    leave the forward out of input order, or in it."""
    if tuple(request.node.callspec.params["generator"]) not in TRANSPORT_CASES:
        pytest.skip("transport compared on Llama (TP=1, TP=2) and DeepSeek-V3")
    rng = random.Random(12)
    prefix = [rng.randrange(VOCAB) for _ in range(40)]
    batch = [prefix + t for t in _seqs(rng, 5, 1, 60)] + _seqs(rng, 4, 1, 90)
    batch = [*batch, batch[2], batch[0]]
    rpc = generator.executor.collective_rpc
    for resorted in (True, False):
        got = {}
        early = rpc(early_fetches)[0]
        if resorted:
            rpc(sort_steps_by_token_count)
        try:
            for mode in ("pickled", "shared", "fallback"):
                rpc(use_transport, args=(mode,))
                got[mode] = generator.generate(batch)
        finally:
            rpc(use_transport, args=("shared",))
            rpc(sort_steps_by_token_count, args=(False,))
        # In the runner's order the shared call's rows left as they were
        # captured (one fetch); re-sorted, they were laid out again.
        if early is not None:  # None: no capture-hooks (vLLM 0.11)
            assert rpc(early_fetches)[0] - early == (0 if resorted else 1)
        _assert_bit_identical(got)


def _assert_bit_identical(got: dict[str, Any]) -> None:
    for mode in ("shared", "fallback"):
        for index, (want, have) in enumerate(
            zip(got["pickled"], got[mode], strict=True)
        ):
            assert torch.equal(want["input_ids"], have["input_ids"])
            for layer, (w, h) in enumerate(
                zip(want["hidden_states"], have["hidden_states"], strict=True)
            ):
                where = f"{mode}: sequence {index}, layer #{layer}"
                assert h.device.type == "cpu" and h.is_contiguous(), where
                # its own rows, no more: torch.save writes what a clone's would
                assert h.untyped_storage().nbytes() == h.nbytes, where
                assert (w.dtype, w.shape) == (h.dtype, h.shape), where
                assert torch.equal(w.cpu().view(torch.uint8), h.view(torch.uint8)), (
                    where
                )


def test_what_generate_returns_is_the_callers_alone(generator, request):
    """Issue 44's shape. With every slab held, a reply whose layers are 1 MiB
    or more comes through the fallback, which vLLM's queue unpickles from its
    shared-memory ring: the caller's tensors lay in that ring and changed a
    few calls later. Each returned tensor must lie in memory only the caller
    writes, and keep its values through later calls."""
    case = request.node.callspec.params["generator"]
    on_gpu = case[1] in ("default", "v2")  # tests/gpu: every model, both runners
    if not on_gpu and (tuple(case) not in TRANSPORT_CASES or case[1] != 1):
        pytest.skip("ownership checked on Llama and DeepSeek-V3 at TP=1 on CPU")
    rng = random.Random(44)
    pids = worker_pids(generator.executor)
    held = [generator.generate(_seqs(rng, 1, 20, 21)) for _ in range(MAX_SLABS)]
    rows = reply_rows(generator, RING_BUFFER, 1) + 1  # a layer of over 1 MiB
    big = generator.generate(batch_of(rng, rows, MAX_MODEL_LEN - 24))
    paths = assert_callers_own(big, pids)
    assert not any(SLAB_NAME in path for path in paths), "not the fallback"
    kept = [
        (tensor, tensor.clone())
        for results in [*held, big]
        for result in results
        for tensor in result["hidden_states"]
    ]
    for _ in range(3):
        assert_callers_own(generator.generate(batch_of(rng, rows, 500)), pids)
    for index, (tensor, copy) in enumerate(kept):
        assert torch.equal(tensor, copy), f"held tensor {index} changed"


@pytest.mark.parametrize("mode", ["drop", "duplicate"])
def test_rows_dropped_or_repeated_in_the_worker_are_refused(generator, mode):
    batch = _seqs(random.Random(9), 4, 5, 40)
    generator.executor.collective_rpc(tamper_captured_rows, args=(mode,))
    try:
        with pytest.raises(specshim.SpecShimError, match="no provable rows"):
            generator.generate(batch)
    finally:
        generator.executor.collective_rpc(tamper_captured_rows, args=(None,))
    # The generator is still usable, and right, afterwards.
    again = generator.generate(batch)
    assert [len(r["hidden_states"][0]) for r in again] == list(map(len, batch))


# Last in the module on purpose: where vLLM's CPU attention cannot take a
# padded forward (0.11; real CPU MLA from 0.29) the padding kills the worker,
# and every later case of the same generator would fail or hang.
def test_padded_forwards_are_refused(generator):
    """A runner that pads each step (CUDA graphs, DP, sequence parallelism do)
    adds rows no sequence owns: every step's rows must be its tokens."""
    batch = _seqs(random.Random(10), 4, 5, 40)
    generator.executor.collective_rpc(pad_steps, args=(3,))
    try:
        with pytest.raises(specshim.SpecShimError, match="belong to no input"):
            generator.generate(batch)
    finally:
        generator.executor.collective_rpc(pad_steps, args=(0,))
    again = generator.generate(batch)
    assert [len(r["hidden_states"][0]) for r in again] == list(map(len, batch))
