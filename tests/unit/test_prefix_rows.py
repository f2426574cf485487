"""Served rows put back (``patches/_transport/prefix_rows.stitch``) and the
store of earlier calls' rows (``specshim._prefix_reuse.PrefixRows``): a
sequence's first rows come only from rows computed after exactly its tokens,
and the store keeps what the plan still needs, under its cap."""

from __future__ import annotations

import random

import pytest
import torch

from specshim._base import UsageError
from specshim._prefix_reuse import PrefixRows, chain, default_store, digest
from specshim.patches._transport.prefix_rows import Capture, keep, stitch

B = 4  # block size
LAYERS = 2


def _states(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 3, generator=g) for _ in range(LAYERS)]


def _capture(*pieces: list[torch.Tensor]) -> Capture:
    """A call's capture as speculators cut it: one piece per sequence."""
    return Capture(list(pieces))


def _assert_own_storage(out: list[list[torch.Tensor] | None]) -> None:
    """Each sequence's rows hold their own storage, no more: a view into
    the call's capture would be saved whole by torch.save (every file the
    size of the call's states)."""
    for states in out:
        for t in states or []:
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def test_a_served_prefix_is_put_back_from_the_sequence_that_computed_it():
    rng = random.Random(0)
    shared = _tokens(rng, 2 * B + 1)
    a, b = shared + _tokens(rng, 3), shared + _tokens(rng, 5)
    ra, rb = _states(len(a), 1), _states(len(b) - 2 * B, 2)  # b: served 2 blocks
    found = [(0, len(a), 0), (len(a), len(a) + len(b) - 2 * B, 2 * B)]
    store = PrefixRows(0)
    out = stitch([b, a], _capture(ra, rb), [found[1], found[0]], B, store)
    assert out[1] is not None and out[0] is not None
    for n in range(LAYERS):
        assert torch.equal(out[1][n], ra[n])
        assert torch.equal(out[0][n], torch.cat([ra[n][: 2 * B], rb[n]]))
    _assert_own_storage(out)
    assert (store.served_tokens, store.computed_tokens) == (2 * B, len(a) + len(rb[0]))


def test_rows_after_other_tokens_are_never_borrowed():
    rng = random.Random(1)
    a = _tokens(rng, 3 * B)
    b = [a[0] + 1, *a[1:]]  # one token differs in the first block
    found = [(0, len(a), 0), (len(a), len(a) + B, 2 * B)]
    out = stitch(
        [a, b], _capture(_states(len(a), 1), _states(B, 2)), found, B, PrefixRows(0)
    )
    assert out[0] is not None and out[1] is None  # computed whole by the caller


def test_an_earlier_calls_rows_are_taken_from_the_store():
    rng = random.Random(2)
    prompt = _tokens(rng, 2 * B)
    first = prompt + _tokens(rng, 3)
    rows = _states(len(first), 3)
    store = PrefixRows(1 << 20)
    store.offer(first, rows, B)
    second = prompt + _tokens(rng, 6)
    tail = _states(6, 4)
    (out,) = stitch([second], _capture(tail), [(0, 6, 2 * B)], B, store)
    assert out is not None
    for n in range(LAYERS):
        assert torch.equal(out[n], torch.cat([rows[n][: 2 * B], tail[n]]))
    (missing,) = stitch(
        [second], _capture(tail), [(0, 6, 2 * B)], B, PrefixRows(1 << 20)
    )
    assert missing is None


def test_a_sequence_of_whole_blocks_read_into_a_longer_run_is_complete():
    rng = random.Random(3)
    short = _tokens(rng, 2 * B)
    long = short + _tokens(rng, 5)
    rows = _states(len(long), 5)  # one run: short's rows then long's tail
    out = stitch(
        [short, long], _capture(rows), [None, (0, len(long), 0)], B, PrefixRows(0)
    )
    assert out[0] is not None
    assert all(torch.equal(out[0][n], rows[n][: 2 * B]) for n in range(LAYERS))
    odd = short + [1]  # not whole blocks: its last row is nobody's
    out = stitch(
        [odd, long], _capture(rows), [None, (0, len(long), 0)], B, PrefixRows(0)
    )
    assert out[0] is None


def test_the_store_keeps_what_the_plan_still_needs_and_no_more():
    rng = random.Random(4)
    prompt = _tokens(rng, 2 * B)
    a, b, c = (prompt + _tokens(rng, 2) for _ in range(3))
    uses = {block: 3 for block in chain(prompt, B)}
    store = PrefixRows(1 << 20, uses=uses)
    store.done(a, B)
    store.offer(a, _states(len(a), 6), B)
    assert len(store.blocks) == 2 and store.held_bytes == 2 * B * 3 * 4 * LAYERS
    store.done(b, B)
    assert len(store.blocks) == 2
    store.done(c, B)  # the last sample sharing them
    assert not store.blocks and store.held_bytes == 0 and not store.uses
    assert store.peak_bytes == 2 * B * 3 * 4 * LAYERS


def test_the_cap_is_enforced():
    rng = random.Random(5)
    ids = _tokens(rng, 3 * B)
    block_bytes = B * 3 * 4 * LAYERS
    store = PrefixRows(block_bytes, uses={h: 2 for h in chain(ids, B)})
    store.offer(ids, _states(len(ids), 7), B)
    assert len(store.blocks) == 1 and store.refused_bytes == 2 * block_bytes
    lru = PrefixRows(2 * block_bytes)  # the library path: the most recent fit
    other = _tokens(rng, 2 * B)
    lru.offer(ids, _states(len(ids), 8), B)
    lru.offer(other, _states(len(other), 9), B)
    # the newest chain, its first block the most recent
    assert list(lru.blocks) == chain(other, B)[::-1]
    assert lru.held_bytes <= 2 * block_bytes


def test_a_full_store_drops_chains_from_their_ends_and_keeps_their_heads():
    """The library path's store over its cap: a block is served only after
    every block before it, so a held block whose parent was dropped is dead
    weight; the store drops leaves first and so keeps the heads that the
    next sequence of a conversation or a shared prompt is served."""
    rng = random.Random(11)
    block_bytes = B * 3 * 4 * LAYERS
    prompt = _tokens(rng, 4 * B)
    store = PrefixRows(3 * block_bytes)
    store.offer(prompt, _states(len(prompt), 1), B)  # 4 blocks, room for 3
    assert list(store.blocks) == chain(prompt, B)[2::-1]  # the first 3, head last
    branch = prompt[:B] + _tokens(rng, 2 * B)  # shares the first block
    store.offer(branch, _states(len(branch), 2), B)
    assert set(store.blocks) == set(chain(branch, B))  # prompt's tail dropped
    assert store.refused_bytes == block_bytes  # the 4th block of prompt, no more

    # Any offers, any cap: every block held has its parent held.
    parents: dict = {}
    for seed in range(40):
        rng = random.Random(seed)
        store = PrefixRows(rng.randrange(1, 12) * block_bytes)
        heads = [_tokens(rng, rng.randrange(1, 5) * B) for _ in range(3)]
        for n in range(30):
            ids = rng.choice(heads)[: rng.randrange(0, 5) * B] + _tokens(
                rng, rng.randrange(0, 4 * B)
            )
            hashes = chain(ids, B)
            parents.update(zip(hashes[1:], hashes[:-1], strict=False))
            store.offer(ids, _states(len(ids), n), B)
            assert store.held_bytes <= store.cap_bytes
            orphans = [
                b
                for b in store.blocks
                if b in parents and parents[b] not in store.blocks
            ]
            assert not orphans, (
                f"seed {seed}, offer {n}: {len(orphans)} held without their parent"
            )


def test_the_library_store_copies_a_chain_once_and_holds_no_dropped_rows():
    """Without a plan, a sequence's new blocks are kept as one copy (one per
    layer, not one a block: 1,152 blocks a call of 32 sequences were 3,456
    clones). Where the cap drops the end of a copy whose head is still held,
    the head is copied anew: the rows held are what was offered for each
    block, and the memory they keep is what the store counts, under its cap."""
    block_bytes = B * 3 * 4 * LAYERS
    for seed in range(40):
        rng = random.Random(seed)
        store = PrefixRows(rng.randrange(1, 12) * block_bytes)
        heads = [_tokens(rng, rng.randrange(1, 5) * B) for _ in range(3)]
        offered: dict = {}
        for n in range(30):
            ids = rng.choice(heads)[: rng.randrange(0, 5) * B] + _tokens(
                rng, rng.randrange(0, 4 * B)
            )
            states, hashes = _states(len(ids), n), chain(ids, B)
            before = set(store.blocks)
            store.offer(ids, states, B)
            kept = set(store.blocks) - before
            new = [j for j, h in enumerate(hashes) if h in kept]
            for j in new:
                offered[hashes[j]] = [h[j * B : (j + 1) * B].clone() for h in states]
            copies = {
                store.blocks[hashes[j]][0].untyped_storage().data_ptr() for j in new
            }
            assert len(copies) <= 1, f"seed {seed}: {len(copies)} copies for one offer"
            for block, rows in store.blocks.items():
                assert all(map(torch.equal, rows, offered[block])), f"seed {seed}"
            memory = {
                r.untyped_storage().data_ptr(): r.untyped_storage().nbytes()
                for rows in store.blocks.values()
                for r in rows
            }
            assert store.held_bytes == sum(memory.values()) <= store.cap_bytes


def test_digest_tells_sequences_apart():
    assert digest([1, 2, 3]) == digest([1, 2, 3]) != digest([1, 2, 4])


@pytest.mark.parametrize(
    ("value", "cap_mib"), [(None, 1024), ("", 1024), ("0", 0), (" 16 ", 16)]
)
def test_the_library_paths_cap_is_read_from_its_variable(monkeypatch, value, cap_mib):
    if value is None:
        monkeypatch.delenv("SPECSHIM_PREFIX_ROWS_MIB", raising=False)
    else:
        monkeypatch.setenv("SPECSHIM_PREFIX_ROWS_MIB", value)
    assert default_store().cap_bytes == cap_mib << 20


@pytest.mark.parametrize("value", ["1g", "-5", "0.5", "lots"])
def test_a_cap_that_is_no_whole_number_is_refused_in_one_line(monkeypatch, value):
    monkeypatch.setenv("SPECSHIM_PREFIX_ROWS_MIB", value)
    with pytest.raises(UsageError) as refused:
        default_store()
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"SPECSHIM_PREFIX_ROWS_MIB={value!r} is not a whole")


def test_a_store_never_serves_rows_of_other_layers():
    """Rows are known by their tokens alone: a store that held one model's
    (or layer set's) rows refuses a call that captured another's."""
    rng = random.Random(11)
    ids = _tokens(rng, 2 * B)
    store = PrefixRows(1 << 20)
    found = [(0, len(ids), 0)]
    stitch([ids], _capture(_states(len(ids), 1)), found, B, store)
    wider = [torch.randn(len(ids), 5) for _ in range(LAYERS)]
    with pytest.raises(UsageError, match="give each generator a store of its own"):
        stitch([ids], _capture(wider), found, B, store)
    fewer = _states(len(ids), 2)[:1]
    with pytest.raises(UsageError, match="store of its own"):
        stitch([ids], _capture(fewer), found, B, store)


def cut(stacked: list[torch.Tensor], lengths: list[int]) -> list[list[torch.Tensor]]:
    """speculators' cut of a call's rows: by each sequence's token count, in
    input order, whatever the cache served (the last pieces come out short
    or empty), each piece cloned into storage of its own."""
    pieces, at = [], 0
    for n in lengths:
        pieces.append([h[at : at + n].clone() for h in stacked])
        at += n
    return pieces


def test_rows_are_copied_at_most_once_and_a_whole_piece_not_at_all():
    """A sequence served nothing whose run is its piece gets that piece (the
    slab's handed-over rows stay where they are); a run across pieces, or
    inside one, is copied once into storage of its own."""
    rng = random.Random(12)
    shared = _tokens(rng, 2 * B)
    a, b, c = shared + _tokens(rng, 3), shared + _tokens(rng, 5), _tokens(rng, 7)
    runs = [_states(len(a), 1), _states(len(b) - 2 * B, 2), _states(len(c), 3)]
    stacked = [torch.cat([r[n] for r in runs]) for n in range(LAYERS)]
    capture = Capture(cut(stacked, [len(a), len(b), len(c)]))
    ra, rb = len(a), len(a) + len(b) - 2 * B
    found = [(0, ra, 0), (ra, rb, 2 * B), (rb, rb + len(c), 0)]
    uses = {h: 3 for h in chain(shared, B)}  # a, b and one sample to come
    store = PrefixRows(1 << 20, uses=uses)
    out = stitch([a, b, c], capture, found, B, store)
    assert out[0] is not None and out[1] is not None and out[2] is not None
    for n in range(LAYERS):
        assert out[0][n].data_ptr() == capture.pieces[0][n].data_ptr()  # no copy
        assert torch.equal(out[1][n], torch.cat([runs[0][n][: 2 * B], runs[1][n]]))
        assert torch.equal(out[2][n], runs[2][n])  # spans b's and c's pieces
    _assert_own_storage(out)
    # The copies are counted, and only they: b whole (served rows and tail),
    # c across two pieces; a's piece is no copy.
    row = 3 * 4  # 3 floats a row
    assert store.copied_bytes == LAYERS * (len(b) + len(c)) * row
    assert store.stitch_seconds > 0  # the joins were timed
    inside = capture.owned(1, 3)  # within a's piece: a copy, not a view
    assert inside[0].data_ptr() != capture.pieces[0][0][1:].data_ptr()
    _assert_own_storage([inside])
    keep([a, b, c], out, B, store, [chain(x, B) for x in (a, b, c)])
    assert store.copied_bytes == LAYERS * (len(b) + len(c) + 2 * B) * row
    assert store.keep_seconds > 0


def random_call(seed: int, stores: int = 2):
    """A random call of sharers (served prefixes, runs from the store,
    whole-block sequences read into longer runs, the capture in input order or
    not): its sequences, stacked capture, ``found`` runs, and ``stores``
    stores holding the same kept rows. None where nothing ran."""
    rng = random.Random(seed)
    prompts = [_tokens(rng, rng.randrange(1, 4) * B) for _ in range(3)]
    seqs = []
    for _ in range(rng.randrange(1, 7)):
        head = rng.choice(prompts) if rng.random() < 0.7 else []
        seqs.append(head + _tokens(rng, rng.randrange(0 if head else 1, 2 * B)))
    made = [PrefixRows(1 << 20) for _ in range(stores)]
    if rng.random() < 0.5:
        kept = _states(len(prompts[0]), seed + 1000)
        for store in made:
            store.offer(prompts[0], kept, B)
    found: list = [None] * len(seqs)
    runs, at = [], 0
    order = list(range(len(seqs)))
    if seed % 2:  # the capture's order, not the input's (V2 runner)
        rng.shuffle(order)
    for i in order:
        ids = seqs[i]
        k = 0 if rng.random() < 0.4 else (len(ids) - 1) // B * B
        if rng.random() < 0.15:
            continue
        runs.append(_states(len(ids) - k, seed * 31 + i))
        found[i] = (at, at + len(ids) - k, k)
        at += len(ids) - k
    if not runs:
        return None
    stacked = [torch.cat([r[n] for r in runs]) for n in range(LAYERS)]
    return seqs, stacked, found, made


def test_reading_the_cut_pieces_gives_what_reading_the_stacked_rows_gives():
    """Over random calls of sharers, stitching speculators' cut pieces gives,
    row for row, what stitching the stacked capture gives."""
    for seed in range(200):
        call = random_call(seed)
        if call is None:
            continue
        seqs, stacked, found, (store, twin) = call
        want = stitch(seqs, Capture([stacked]), found, B, twin)
        got = stitch(
            seqs, Capture(cut(stacked, [len(s) for s in seqs])), found, B, store
        )
        for x, y in zip(want, got, strict=True):
            assert (x is None) == (y is None), seed
            for u, v in zip(x or [], y or [], strict=True):
                assert torch.equal(u, v), seed
        _assert_own_storage(got)


def test_what_stitch_returns_is_each_sequences_alone():
    """Writing into one sequence's returned rows changes no other sequence's
    rows and no block the store keeps; no two returned tensors share memory;
    and a piece that is a view of a larger tensor is copied, never handed
    out (torch.save would write the whole tensor under it)."""
    rng = random.Random(13)
    shared = _tokens(rng, 2 * B)
    a, b, c = shared + _tokens(rng, 3), shared + _tokens(rng, 5), _tokens(rng, 2 * B)
    runs = [_states(len(a), 1), _states(len(b) - 2 * B, 2), _states(len(c), 3)]
    lengths = [len(a), len(b) - 2 * B, len(c)]
    stacked = [torch.cat([r[n] for r in runs]) for n in range(LAYERS)]
    ra, rb = len(a), len(a) + lengths[1]
    found = [(0, ra, 0), (ra, rb, 2 * B), (rb, rb + len(c), 0)]
    as_views, at = [], 0  # pieces that view one tensor: storage not their own
    for n in lengths:
        as_views.append([h[at : at + n] for h in stacked])
        at += n
    for pieces in (cut(stacked, [len(a), len(b), len(c)]), as_views):
        store = PrefixRows(1 << 20)
        out = stitch([a, b, c], Capture(pieces), found, B, store)
        assert all(states is not None for states in out)
        _assert_own_storage(out)
        pointers = [t.data_ptr() for states in out for t in states or []]
        assert len(set(pointers)) == len(pointers)
        for ids, states in zip([a, b, c], out, strict=True):
            store.offer(ids, states, B)  # type: ignore[arg-type]
        kept = {k: [t.clone() for t in v] for k, v in store.blocks.items()}
        before = [[t.clone() for t in states or []] for states in out]
        for t in out[0] or []:
            t.fill_(7.0)  # the caller writes into a's rows
        for states, old in zip(out[1:], before[1:], strict=True):
            assert all(
                torch.equal(t, u) for t, u in zip(states or [], old, strict=True)
            )
        for block, rows in store.blocks.items():
            assert all(
                torch.equal(t, u) for t, u in zip(rows, kept[block], strict=True)
            )
        assert all(torch.equal(t, stacked[n][rb:]) for n, t in enumerate(out[2] or []))
