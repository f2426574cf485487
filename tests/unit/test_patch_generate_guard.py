"""The generate_guard patch: input checks, row proofs and reordering."""

from __future__ import annotations

import logging

import pytest
import torch

from specshim._base import SpecShimError
from specshim.patches.main import generate_guard


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ([], "empty batch"),
        ([[1, 2], []], "sequence 1 is empty"),
        ([[1, 320]], "token id 320"),
        ([[-1, 3]], "token id -1"),
    ],
)
def test_generate_inputs_rejected(batch, message):
    with pytest.raises(SpecShimError, match=message):
        generate_guard.check_inputs(batch, vocab_size=320, max_model_len=16)


def test_generate_input_tensor_and_long_sequences_warn(caplog):
    with caplog.at_level(logging.WARNING):
        generate_guard.check_inputs(torch.ones(3, 20, dtype=torch.long), 320, 16)
    assert "3 of 3 sequences are longer" in caplog.text


def _record(runs, rows=None):
    """A worker record: ``runs`` is a list of (token ids, first position)."""
    ids = [t for r, _ in runs for t in r]
    positions = [p + i for r, p in runs for i in range(len(r))]
    return {
        "token_ids": torch.tensor(ids, dtype=torch.long),
        "positions": torch.tensor(positions, dtype=torch.long),
        "rows": rows if rows is not None else [len(ids)],
        "problems": [],
    }


def test_prove_rows_finds_each_sequence_whatever_the_order():
    batch = [[1, 2, 3], [1, 2], [9], [1, 2]]  # shared prefix, duplicates
    record = _record([([9], 0), ([1, 2], 0), ([1, 2, 3], 0), ([1, 2], 0)])
    begin = generate_guard.prove_rows(batch, record)
    assert begin == [3, 1, 0, 6]


def test_reorder_keeps_input_order_untouched():
    batch = [[1, 2], [3]]
    results = [
        {"input_ids": torch.tensor(ids), "hidden_states": [torch.zeros(len(ids), 1)]}
        for ids in batch
    ]
    assert generate_guard.reorder(results, batch, [0, 2]) is results


@pytest.mark.parametrize(
    ("runs", "rows", "message"),
    [
        # second request never computed (did not fit the cache)
        ([([1, 2], 0)], None, "no rows computed for sequence"),
        # partial prefill: the second request's first step only
        ([([1, 2], 0), ([3], 0)], None, r"no rows computed for sequence\(s\) 1"),
        # chunked across steps: the rest starts at position 1
        ([([1, 2], 0), ([3], 0), ([4], 1)], [3, 1], "position 1"),
        # a prefix-cache hit: rows start at position 1
        ([([1, 2], 0), ([4], 1)], None, "position 1"),
        # padding rows and a duplicated request
        ([([1, 2], 0), ([3, 4], 0), ([0, 0], 0)], None, "belong to no input"),
        ([([1, 2], 0), ([1, 2], 0), ([3, 4], 0)], None, "belong to no input"),
        # the same tokens at shifted rows inside one run
        ([([1, 2, 3, 4], 0)], None, "no rows computed"),
    ],
)
def test_prove_rows_refuses_what_it_cannot_prove(runs, rows, message):
    with pytest.raises(SpecShimError, match=message):
        generate_guard.prove_rows([[1, 2], [3, 4]], _record(runs, rows))


def test_prove_rows_refuses_forwards_recorded_as_unprovable():
    record = _record([([1, 2], 0)])
    record["problems"] = ["2 rows captured for 3 embedded tokens"]
    with pytest.raises(SpecShimError, match="2 rows captured for 3"):
        generate_guard.prove_rows([[1, 2]], record)


def test_reorder_checks_shapes_before_reslicing():
    batch = [[1, 2], [3, 4]]
    results = [
        {"input_ids": torch.tensor(ids), "hidden_states": [torch.zeros(1, 1)]}
        for ids in batch
    ]
    with pytest.raises(SpecShimError, match="sequence 0 has 2 tokens but 1 rows"):
        generate_guard.reorder(results, batch, [2, 0])
