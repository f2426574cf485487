"""Runs of captured rows where vLLM's prefix cache served the first blocks
(issue 47's proof, not yet wired to a flag): a run may start a whole number
of blocks into its sequence, is matched by the sequence's tail, and where
two sequences with that tail differ before it, neither is taken."""

from __future__ import annotations

import random

import pytest
import torch

from specshim import SpecShimError
from specshim.patches._transport import rows as rows_module
from specshim.patches._transport.rows import match_runs, match_tails

BLOCK = 4


def _capture(*pieces: tuple[list[int], int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward's token ids and positions: each piece is (tokens, first
    position)."""
    ids = [t for tokens, _ in pieces for t in tokens]
    positions = [k + i for tokens, k in pieces for i in range(len(tokens))]
    return torch.tensor(ids), torch.tensor(positions)


P, Q = [1, 2, 3, 4], [9, 8, 7, 6]  # two different first blocks
A, B = P + [10, 11, 12], P + [20, 21]


def test_without_a_cache_it_matches_as_match_runs_does():
    ids, positions = _capture((A, 0), (B, 0))
    found, strays, untold = match_tails([A, B], ids, positions, [13], BLOCK)
    assert found == [(0, 7, 0), (7, 13, 0)] and strays == [] and untold == []
    assert match_runs([A, B], ids, positions, [13]) == ([(0, 7), (7, 13)], [])


def test_a_run_served_its_first_block_is_matched_by_its_tail():
    ids, positions = _capture((A, 0), (B[4:], 4))
    found, strays, untold = match_tails([A, B], ids, positions, [9], BLOCK)
    assert found == [(0, 7, 0), (7, 9, 4)] and strays == [] and untold == []


def test_without_a_block_size_a_served_run_is_refused_as_today():
    ids, positions = _capture((A, 0), (B[4:], 4))
    with pytest.raises(SpecShimError, match="partial or cached prefill"):
        match_runs([A, B], ids, positions, [9])


def test_a_run_that_starts_inside_a_block_is_refused():
    ids, positions = _capture((A, 0), (B[3:], 3))
    with pytest.raises(SpecShimError, match="no whole number of 4-token"):
        match_tails([A, B], ids, positions, [9], BLOCK)


def test_a_gap_inside_a_run_starts_a_run_that_must_be_whole_blocks():
    ids, positions = _capture((A[:2], 0), (A[3:], 3))
    with pytest.raises(SpecShimError, match="position 3"):
        match_tails([A], ids, positions, [6], BLOCK)


def test_one_tail_after_two_different_prefixes_is_never_guessed():
    tail = [30, 31, 32]
    first, second = P + tail, Q + tail
    ids, positions = _capture((tail, 4), (tail, 4))
    found, strays, untold = match_tails([first, second], ids, positions, [6], BLOCK)
    assert found == [None, None] and strays == [] and untold == [0, 1]


def test_a_whole_run_is_still_proven_beside_an_untold_tail():
    tail = [30, 31, 32]
    first, second = P + tail, Q + tail
    ids, positions = _capture((first, 0), (tail, 4))
    found, strays, untold = match_tails([first, second], ids, positions, [10], BLOCK)
    assert found == [(0, 7, 0), None] and strays == [] and untold == [1]


def test_exact_duplicates_take_a_whole_run_and_a_served_one():
    ids, positions = _capture((A, 0), (A[4:], 4))
    found, strays, untold = match_tails([A, A], ids, positions, [10], BLOCK)
    assert found == [(0, 7, 0), (7, 10, 4)] and strays == [] and untold == []


def test_a_second_run_for_one_sequence_is_a_stray():
    ids, positions = _capture((A, 0), (A[4:], 4))
    found, strays, untold = match_tails([A], ids, positions, [10], BLOCK)
    assert found == [(0, 7, 0)] and strays == [(7, 10)] and untold == []


def test_runs_across_forwards_keep_their_first_positions():
    first, second = _capture((A, 0)), _capture((B[4:], 4))
    ids, positions = torch.cat([first[0], second[0]]), torch.cat([first[1], second[1]])
    found, _, _ = match_tails([B, A], ids, positions, [7, 2], BLOCK)
    assert found == [(7, 9, 4), (0, 7, 0)]


def test_a_served_run_that_continues_the_run_before_it_is_a_stray():
    longer = P + [5, 6, 7, 8]  # 8 tokens: positions 0-7
    after = P + [40, 41, 42, 43] + [50]  # its first 8 served: position 8 on
    ids, positions = _capture((longer, 0), ([50], 8))
    found, strays, _ = match_tails([longer, after], ids, positions, [9], BLOCK)
    assert found == [None, None] and strays == [(0, 9)]


def test_a_second_whole_run_beside_an_untold_tail_is_still_a_stray():
    """A sequence left untold at one k does not hide an extra run of its at
    another k: that run is a stray, refused, not dropped."""
    tail = [30, 31, 32]
    first, second = P + tail, Q + tail
    ids, positions = _capture((first, 0), (first, 0), (tail, 4))
    found, strays, untold = match_tails([first, second], ids, positions, [17], BLOCK)
    assert found == [(0, 7, 0), None] and strays == [(7, 14)] and untold == [1]


@pytest.mark.parametrize("s_served", [True, False])
def test_a_tail_lent_by_another_head_is_never_taken_for_a_whole_run(s_served):
    """C is one block; X, served Q, has C's next tokens as its tail; S is C
    and that tail. X's served tail follows on from C's rows, so C's rows and
    X's tail read as one run 0..6 whose tokens are S's: taken, S would get
    rows computed after Q. S is computed whole instead (and X too)."""
    tail = [30, 31, 32]
    c, x, s = P, Q + tail, P + tail
    third = (tail, 4) if s_served else (s, 0)
    ids, positions = _capture((c, 0), (tail, 4), third)
    found, strays, untold = match_tails(
        [c, x, s], ids, positions, [14 - 4 * s_served], BLOCK
    )
    assert found[0] is None or found[0] == (0, 4, 0)
    assert found[1] is None and found[2] is None
    assert 2 in untold


def test_a_tail_that_only_continues_the_same_tokens_is_still_taken():
    """The other side: where the sequence that may have lent the tail has the
    same tokens before it, the rows are the same; nothing is recomputed."""
    longer = P + [5, 6, 7, 8] + [50]
    shorter = P + [5, 6, 7, 8]  # longer's first 8 tokens
    ids, positions = _capture((shorter, 0), ([50], 8))
    found, strays, untold = match_tails([shorter, longer], ids, positions, [9], BLOCK)
    assert found == [None, (0, 9, 0)] and untold == []
    assert strays == []


def test_a_lent_tail_at_the_start_of_a_served_run_is_never_taken():
    """J, served Q, computes [5..8] at 4; a duplicate of I, served 8 tokens,
    computes [9, 9, 9] at 8 right after: one run at 4 with I's tail. Its first
    rows followed Q, not P: I is computed whole; the duplicate keeps its own
    whole run."""
    i = P + [5, 6, 7, 8] + [9, 9, 9]
    j = Q + [5, 6, 7, 8]
    ids, positions = _capture(([5, 6, 7, 8], 4), ([9, 9, 9], 8), (i, 0))
    found, strays, untold = match_tails([i, list(i), j], ids, positions, [18], BLOCK)
    assert found[0] is None and 0 in untold
    assert found[1] == (7, 18, 0)


def _sharers(rng: random.Random) -> list[list[int]]:
    """A call whose sequences lend each other tails: from a sequence ``i``
    over two tokens, pieces ``i[a:b]`` (``a`` a whole block) after ``i``'s own
    head or another one, duplicates of ``i``, and ``i`` itself."""
    i = [rng.randrange(1, 3) for _ in range(rng.randint(2 * BLOCK, 6 * BLOCK + 3))]
    call = [i]
    for _ in range(rng.randint(2, 5)):
        a = rng.randrange(0, len(i) - 1, BLOCK)
        b = rng.randint(a + 1, len(i))
        own = rng.random() < 0.3
        head = i[:a] if own else [rng.randrange(1, 3) for _ in range(a)]
        call.append(head + i[a:b])
    if rng.random() < 0.3:
        call.append(list(i))
    return call


def _wrong_rows(cases: int) -> tuple[int, int]:
    """(matched sequences checked, those given a row computed after other
    tokens than their own), over random calls: each request computed from a
    whole block it was served (fewer than all its tokens) to its end, the
    requests in a random order in one forward."""
    rng = random.Random(3)
    checked = wrong = 0
    for _ in range(cases):
        call = _sharers(rng)
        order = rng.sample(range(len(call)), len(call))
        served = {r: rng.randrange(0, len(call[r]), BLOCK) for r in order}
        made = [(r, t) for r in order for t in range(served[r], len(call[r]))]
        ids = torch.tensor([call[r][t] for r, t in made])
        positions = torch.tensor([t for _, t in made])
        try:
            found, _, _ = match_tails(call, ids, positions, [len(made)], BLOCK)
        except SpecShimError:
            continue  # refused loudly: never wrong
        for x, hit in enumerate(found):
            if hit is not None:
                checked += 1
                start, end, _ = hit
                wrong += any(
                    call[r][: t + 1] != call[x][: t + 1] for r, t in made[start:end]
                )
    return checked, wrong


def test_no_matched_run_holds_a_row_computed_after_other_tokens(monkeypatch):
    """Every row of every matched run was computed after exactly its
    sequence's tokens, whatever the order and the served blocks; without the
    lent-tail check the same calls give rows computed after other heads."""
    checked, wrong = _wrong_rows(1500)
    assert wrong == 0 and checked > 1500
    monkeypatch.setattr(
        rows_module._Lenders, "may_hold_a_lent_tail", lambda *args: False
    )
    assert _wrong_rows(1500)[1] >= 10
