"""Early copies (``_transport/early_copies``): a call's layers copied into its
slab as they are captured, and used by the fetch only where they are exactly
what it would write; the guard's runner order, which makes them usable under
the V2 runner. The real workers are compared with the fetch's own copies bit
for bit in tests/e2e (test_reference_match, test_extract_integrity)."""

from __future__ import annotations

import types

import pytest
import torch

from specshim._base import SpecShimError
from specshim.patches._transport import early_copies
from specshim.patches.main import generate_guard
from specshim.patches.worker import state_transport

from ._transport_helpers import _forward, _received, _states, _Worker


def _capturing(tmp_path, batches, expected=None):
    """A worker that captured ``batches`` (one list of runs per forward), its
    early copies made from the hooks' tensors as a real capture makes them."""
    forwards = [_forward(runs) for runs in batches]
    worker = _Worker(forwards, str(tmp_path))
    worker._layer_ids = frozenset({3, 7})
    if expected is None:
        expected = [run for runs in batches for run in runs]
    worker._specshim_expected = expected
    early_copies.begin(worker, expected)
    stored = worker._captured_states
    for f in range(len(forwards)):
        for position, layer in enumerate(stored):
            worker._specshim_early.on_layer(position, layer[f])
    record = types.SimpleNamespace(forwards=forwards, moved=0)
    worker._specshim_provenance = record
    return worker


def _no_send(monkeypatch):
    def send(*_):
        raise AssertionError("the fetch copied the rows again")

    monkeypatch.setattr(state_transport, "send", send)


def _concatenated(worker_states):
    return [torch.cat(layer) for layer in worker_states]


def test_rows_captured_in_input_order_leave_through_the_early_copies(
    tmp_path, monkeypatch
):
    worker = _capturing(tmp_path, [[[1, 2, 3], [4]], [[5, 6]]])
    want = _concatenated(worker._captured_states)
    slab = worker._specshim_early.slab
    _no_send(monkeypatch)
    reply = state_transport.get_captured_states(worker)
    assert reply.args[0] == slab.path
    layers = _received(reply)
    assert [torch.equal(a, b) for a, b in zip(layers, want, strict=True)] == [1, 1]
    assert worker._specshim_early is None and worker._captured_states is None
    worker._specshim_region.close()


def _fetched_by_send(worker, monkeypatch):
    """The reply, and whether the fetch had to copy the rows itself."""
    calls = []
    send = state_transport.send

    def counted(*args):
        calls.append(1)
        return send(*args)

    monkeypatch.setattr(state_transport, "send", counted)
    layers = _received(state_transport.get_captured_states(worker))
    worker._specshim_region.close()
    return layers, bool(calls)


def test_rows_out_of_input_order_are_copied_again_in_it(tmp_path, monkeypatch):
    worker = _capturing(tmp_path, [[[4], [1, 2, 3]]], expected=[[1, 2, 3], [4]])
    layers, sent = _fetched_by_send(worker, monkeypatch)
    assert sent
    assert layers[0][:, 0].tolist() == [1, 2, 3, 0]  # row numbers in the forward


def test_a_store_that_replaced_the_rows_is_never_answered_with_the_copies(
    tmp_path, monkeypatch
):
    """A runner or store that trims or pads what the hooks computed stores
    other tensors: the fetch must send what was stored, not what was copied."""
    worker = _capturing(tmp_path, [[[1, 2, 3], [4]]])
    trimmed = [[layer[0][:-1]] for layer in worker._captured_states]
    worker._captured_states = trimmed
    worker._specshim_provenance = None
    layers, sent = _fetched_by_send(worker, monkeypatch)
    assert sent
    assert [torch.equal(a, b[0]) for a, b in zip(layers, trimmed, strict=True)] == [
        1,
        1,
    ]


def test_more_rows_than_the_call_expects_are_not_copied_early(tmp_path, monkeypatch):
    worker = _capturing(tmp_path, [[[1, 2, 3], [4]]], expected=[[1, 2, 3]])
    assert worker._specshim_early.broken
    want = _concatenated(worker._captured_states)
    layers, sent = _fetched_by_send(worker, monkeypatch)
    assert sent and torch.equal(layers[1], want[1])


def test_a_forward_with_a_layer_missing_breaks_the_copies(tmp_path):
    worker = _Worker([_forward([[1, 2]]), _forward([[3]])], str(tmp_path))
    worker._layer_ids = frozenset({3, 7})
    early_copies.begin(worker, [[1, 2], [3]])
    early = worker._specshim_early
    stored = worker._captured_states
    early.on_layer(0, stored[0][0])  # the forward's second layer never came
    early.on_layer(0, stored[0][1])
    early.on_layer(1, stored[1][1])
    assert early.broken
    assert not early.holds(stored, [(0, 0, 2), (1, 0, 1)])
    worker._specshim_region.close()


def test_a_new_call_waits_for_the_last_calls_copies(tmp_path):
    worker = _Worker([_forward([[1]])], str(tmp_path))
    worker._layer_ids = frozenset({1})
    finished = []
    worker._specshim_early = types.SimpleNamespace(finish=lambda: finished.append(1))
    early_copies.begin(worker, [[5, 6]])
    assert finished == [1]
    assert worker._specshim_early.rows == 2
    early_copies.begin(worker, None)  # a call the guard sends no sequences for
    assert worker._specshim_early is None


def test_without_a_slab_the_copies_give_way_to_the_fallback(monkeypatch):
    worker = _Worker([_forward([[1, 2]])], "/nonexistent-shm")
    worker._layer_ids = frozenset({1, 2})
    early_copies.begin(worker, [[1, 2]])
    for position, layer in enumerate(worker._captured_states):
        worker._specshim_early.on_layer(position, layer[0])
    assert worker._specshim_early.broken
    want = _concatenated(worker._captured_states)
    layers, sent = _fetched_by_send(worker, monkeypatch)
    assert sent and torch.equal(layers[0], want[0])


@pytest.mark.parametrize(
    ("lengths", "order"),
    [
        ([1, 2, 2, 5], None),  # already as the runner computes them
        ([5, 2, 1, 2], [2, 1, 3, 0]),  # shortest first, ties as given
    ],
)
def test_the_guard_sends_sequences_shortest_first(lengths, order):
    sequences = [[7] * n for n in lengths]
    assert generate_guard.runner_order(sequences) == order


def _generator():
    model = types.SimpleNamespace(get_vocab_size=lambda: 50, max_model_len=64)
    cache = types.SimpleNamespace(enable_prefix_caching=False)
    config = types.SimpleNamespace(model_config=model, cache_config=cache)
    return types.SimpleNamespace(vllm_config=config)


def _result(ids):
    rows = torch.tensor(ids, dtype=torch.float32)[:, None]
    return {"input_ids": torch.tensor(ids), "hidden_states": [rows]}


def test_results_come_back_in_the_callers_order(monkeypatch):
    batch = [[1, 2, 3], [4], [5, 6]]
    sent = []

    def call(self, original, token_ids, sequences):
        sent.append(token_ids)
        runs = [(ids, 0) for ids in sequences]
        record = _record(runs)
        return [_result(ids) for ids in sequences], record

    monkeypatch.setattr(generate_guard, "_call", call)
    generate = generate_guard._build(lambda *_: None)
    results = generate(_generator(), batch)
    assert sent == [[[4], [5, 6], [1, 2, 3]]]
    assert [r["input_ids"].tolist() for r in results] == batch
    assert [r["hidden_states"][0][:, 0].tolist() for r in results] == batch


def test_a_refusal_names_the_callers_sequence(monkeypatch):
    batch = [[1, 2, 3], [4], [5, 6]]

    def call(self, original, token_ids, sequences):
        runs = [(ids, 0) for ids in sequences if ids != [1, 2, 3]]
        return [_result(ids) for ids in sequences], _record(runs)

    monkeypatch.setattr(generate_guard, "_call", call)
    generate = generate_guard._build(lambda *_: None)
    with pytest.raises(SpecShimError, match=r"sequence\(s\) 0 \(1 of 3\)"):
        generate(_generator(), batch)


def _record(runs):
    ids = [t for r, _ in runs for t in r]
    positions = [p + i for r, p in runs for i in range(len(r))]
    return {
        "token_ids": torch.tensor(ids, dtype=torch.long),
        "positions": torch.tensor(positions, dtype=torch.long),
        "rows": [len(ids)],
        "problems": [],
    }


def test_the_helpers_states_say_where_each_row_came_from():
    """The stand-in capture this file builds on: row r of forward f reads
    (r, f) in the first layer, negated in the second."""
    layers = _states([_forward([[1, 2]]), _forward([[3]])])
    assert layers[0][1].tolist() == [[0.0, 1.0]]
    assert layers[1][0][:, 0].tolist() == [0.0, -1.0]


def test_adjacent_runs_of_a_forward_move_as_one_copy():
    batch = [[5, 6, 7], [8], [1, 2]]
    forwards = [_forward([[1, 2], [5, 6, 7], [8]])]
    pieces, _, moved = state_transport.input_order(batch, forwards)
    assert pieces == [(0, 2, 4), (0, 0, 2)]
    assert moved == 3


def test_the_in_order_check_finds_what_match_runs_finds():
    """Random calls, in input order or not, split across forwards or not:
    where ``in_input_order`` says yes, ``match_runs`` puts every sequence at
    its own offset with no stray; where it is shuffled or a sequence spans
    two forwards (a partial prefill, which the strict proof refuses), no."""
    import random

    from specshim.patches._transport.rows import in_input_order, match_runs

    rng = random.Random(45)
    said = {True: 0, False: 0}
    for _ in range(300):
        batch = [[rng.randrange(4) for _ in range(rng.randint(1, 5))] for _ in range(5)]
        sent = list(batch)
        if rng.random() < 0.5:
            rng.shuffle(sent)
        ids = torch.tensor([t for s in sent for t in s])
        positions = torch.tensor([p for s in sent for p in range(len(s))])
        total = len(ids)
        cut = rng.randint(1, total - 1) if rng.random() < 0.5 else total
        rows = [cut, total - cut] if cut < total else [total]
        fast = in_input_order(batch, ids, positions, rows)
        said[fast] += 1
        offsets = [sum(map(len, batch[:i])) for i in range(len(batch))]
        try:
            found, strays = match_runs(batch, ids, positions, rows)
        except SpecShimError:
            assert not fast
            continue
        proven = not strays and [run and run[0] for run in found] == offsets
        assert fast == (
            proven
            and all(
                sum(rows[: k + 1])
                in {o + len(s) for o, s in zip(offsets, batch, strict=True)}
                for k in range(len(rows))
            )
        )
    assert said[True] > 50 and said[False] > 50


def test_whole_runs_in_input_order_are_what_match_tails_finds():
    """With the prefix cache on: random calls (a vocabulary of 3, so shared
    prefixes, shared tails and duplicates abound), in input order or not,
    split or not, some served a leading block. Where the fast path answers,
    nothing was served and match_tails finds the same run for every sequence
    or none (it refuses a run another sequence might have lent a tail, which
    a whole run in input order cannot hold); never another run, never a
    stray."""
    import random

    from specshim.patches._transport.rows import match_tails, whole_in_input_order

    rng = random.Random(47)
    said = {True: 0, False: 0}
    for _ in range(300):
        batch = [[rng.randrange(3) for _ in range(rng.randint(1, 6))] for _ in range(5)]
        sent = [(s, 0) for s in batch]
        if rng.random() < 0.5:
            rng.shuffle(sent)
        if rng.random() < 0.3:  # the cache served someone's first block of 2
            at = rng.randrange(len(sent))
            if len(sent[at][0]) > 2:
                sent[at] = (sent[at][0], 2)
        ids = torch.tensor([t for s, k in sent for t in s[k:]])
        positions = torch.tensor([p for s, k in sent for p in range(k, len(s))])
        total = len(ids)
        cut = rng.randint(1, total - 1) if rng.random() < 0.5 else total
        rows = [cut, total - cut] if cut < total else [total]
        fast = whole_in_input_order(batch, ids, positions, rows)
        said[fast is not None] += 1
        if fast is None:
            continue
        assert all(k == 0 for _, k in sent)
        # (match_tails raising here fails the test: it refuses what the fast
        # path accepted)
        found, strays, _ = match_tails(batch, ids, positions, rows, 2)
        assert not strays
        for mine, theirs in zip(fast, found, strict=True):
            assert theirs is None or theirs == mine
    assert said[True] > 50 and said[False] > 50
