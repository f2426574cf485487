"""Kept prefixes in one piece: with a plan, the blocks the same samples
share are one copy in ``PrefixRows`` (its bytes held until its last block
goes), and ``prefix_rows.merged`` reads pieces that follow one another in
one storage as one, so a sequence served them joins one piece."""

from __future__ import annotations

import random

import numpy as np
import torch

from specshim._prefix_reuse import PrefixRows, chain
from specshim.patches._transport.prefix_rows import merged

B = 4  # block size
LAYERS = 2


def _states(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 3, generator=g) for _ in range(LAYERS)]


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def test_blocks_the_same_samples_share_are_kept_as_one_copy():
    """With a plan, consecutive blocks with as many uses left are one copy,
    dropped together as their samples complete; a sequence served them
    joins one piece; the bytes held go only with the last block of a copy."""
    rng = random.Random(21)
    prompt = _tokens(rng, 3 * B)
    deeper = prompt + _tokens(rng, B)  # a fourth block only two samples share
    samples = [deeper + [1], deeper + [2], prompt + [3]]
    hashes = chain(deeper, B)
    uses = {hashes[0]: 3, hashes[1]: 3, hashes[2]: 3, hashes[3]: 2}
    store = PrefixRows(1 << 20, uses=dict(uses))
    rows = _states(len(samples[0]), 7)
    store.done(samples[0], B)  # the first sample is complete, then offered
    store.offer(samples[0], rows, B)
    kept = [store.get(h) for h in hashes]
    assert all(k is not None for k in kept)
    for n in range(LAYERS):
        copies = {k[n].untyped_storage().data_ptr() for k in kept[:3]}
        assert len(copies) == 1  # the three blocks all share: one copy
        assert kept[3][n].untyped_storage().data_ptr() not in copies  # apart
        heads = [k[n] for k in kept]
        assert [p.shape[0] for p in merged(heads)] == [3 * B, B]
        assert torch.equal(torch.cat(merged(heads)), rows[n][: 4 * B])
    block_bytes = B * 3 * 4 * LAYERS
    assert store.held_bytes == 4 * block_bytes
    store.done(samples[1], B)  # the last of the fourth block's sharers
    assert store.get(hashes[3]) is None and store.held_bytes == 3 * block_bytes
    store._drop(hashes[2])  # a copy's memory goes with its last block
    assert store.held_bytes == 3 * block_bytes
    store.done(samples[2], B)
    assert not store.blocks and store.held_bytes == 0


def test_merged_pieces_read_the_same_rows():
    """Pieces merged where one starts at the next row of another's storage,
    never otherwise: over random cuts of a few tensors, the rows are those
    of the pieces one after another."""
    for seed in range(100):
        rng = random.Random(seed)
        bases = [torch.randn(rng.randrange(1, 12), 3) for _ in range(3)]
        parts = []
        for _ in range(rng.randrange(1, 8)):
            base = rng.choice(bases)
            a = rng.randrange(base.shape[0])
            b = rng.randrange(a, base.shape[0] + 1)
            parts.append(base[a:b])
            if rng.random() < 0.5 and b < base.shape[0]:
                parts.append(base[b : rng.randrange(b, base.shape[0] + 1)])
        got = merged(parts)
        assert torch.equal(torch.cat(got), torch.cat(parts)), seed
        assert len(got) <= len(parts)
    base = torch.randn(10, 3)
    assert len(merged([base[0:2], base[2:5], base[5:9]])) == 1
    assert len(merged([base[0:2], base[3:5]])) == 2  # a row between
    assert len(merged([base[2:5], base[0:2]])) == 2  # the wrong order
    assert len(merged([base[0:2], base.clone()[2:5]])) == 2  # another storage
    buffer = np.zeros(24, dtype=np.float32)  # two storages, one after the other
    first = torch.from_numpy(buffer[:12]).view(4, 3)
    second = torch.from_numpy(buffer[12:]).view(4, 3)
    assert second.data_ptr() == first.data_ptr() + 48
    assert len(merged([first, second])) == 2
    odd = base[:1].as_strided((1, 3), (7, 1))  # one row of another stride
    assert len(merged([odd, base[1:3]])) == 2


def test_without_a_plan_a_copy_never_served_goes_whole_and_a_served_head_once():
    """The library store drops a chain from its end; a copy no later sequence
    was served (a sample's own tail) goes whole, instead of being copied anew
    without its last block on every offer (on an H100 that was 32 copies and
    39 ms a call of 32 sequences); a copy whose head was served keeps the
    head, copied once."""
    block = B * 3 * 4 * LAYERS  # a block's bytes: B rows of 3 floats a layer
    rng = random.Random(0)
    store = PrefixRows(6 * block)
    a, b = _tokens(rng, 4 * B), _tokens(rng, 4 * B)
    store.offer(a, _states(len(a), 1), B)
    store.offer(b, _states(len(b), 2), B)  # room for b: a goes, all of it
    assert store.copied_bytes == 8 * block  # what was offered, no more
    assert not set(chain(a, B)) & set(store.blocks)
    assert store.held_bytes == 4 * block
    head = _tokens(rng, 2 * B)
    d = head + _tokens(rng, 2 * B)
    e = head + _tokens(rng, 2 * B)
    d_states = _states(len(d), 3)
    store.offer(d, d_states, B)  # b goes whole
    store.offer(e, _states(len(e), 4), B)  # served the head: d's copy is served
    copied = store.copied_bytes
    store.offer(_tokens(rng, 2 * B), _states(2 * B, 5), B)  # d's tail goes
    assert store.copied_bytes == copied + 2 * block + 2 * block  # offer + head
    held = [store.blocks[h] for h in chain(d, B)[:2]]
    for j, rows in enumerate(held):
        want = [s[j * B : (j + 1) * B] for s in d_states]
        assert all(map(torch.equal, rows, want))
    assert store.held_bytes <= store.cap_bytes
