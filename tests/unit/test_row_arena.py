"""The memory served rows are joined into (``patches/_transport/row_arena``):
a region is written again only once every tensor over it is gone, so what
``stitch`` hands over stays the caller's however long it is held."""

from __future__ import annotations

import mmap
import os
import random

import pytest
import torch

from specshim._base import STITCH_REGIONS, UsageError
from specshim._prefix_reuse import PrefixRows, chain
from specshim.patches._transport import row_arena
from specshim.patches._transport.prefix_rows import Capture, stitch

B = 4


def _like(width: int = 8) -> torch.Tensor:
    return torch.empty(0, width, dtype=torch.bfloat16)


def test_a_region_is_lent_again_only_once_every_tensor_over_it_is_gone():
    arena = row_arena.Arena()
    joins = arena.lease(10_000)
    assert joins is not None
    region = joins.region
    first = joins.empty(100, _like())
    second = joins.empty(100, _like())
    assert first is not None and second is not None
    assert first.untyped_storage().nbytes() == 100 * 8 * 2  # its rows, no more
    assert first.data_ptr() % row_arena.ALIGN == 0
    assert second.data_ptr() >= first.data_ptr() + 1600  # no overlap
    del joins
    other = arena.lease(10_000)  # the first region is still held
    assert other is not None and other.region is not region
    del other
    view = second[10:20]  # a view keeps the region too
    del first, second
    again = arena.lease(10_000)
    assert again is not None and again.region is not region
    del view, again
    assert not any(r.lent for r in arena.regions)  # let go: free at once
    reused = arena.lease(10_000)
    assert reused is not None and reused.region is region
    assert len(arena.regions) == 2  # nothing new mapped


def test_room_runs_out_and_regions_are_bounded(monkeypatch):
    monkeypatch.setenv(STITCH_REGIONS, "2")
    arena = row_arena.Arena()
    joins = arena.lease(1000)
    assert joins is not None and joins.size == mmap.PAGESIZE  # 1,250 rounded up
    half = joins.size // 2 // 2 - row_arena.ALIGN  # rows of 2 bytes
    assert joins.empty(half, _like(1)) is not None
    assert joins.empty(half, _like(1)) is not None  # from the next 64 bytes
    assert joins.empty(joins.size // 2, _like(1)) is None  # no room: elsewhere
    held = [joins, arena.lease(1000)]
    assert held[1] is not None
    assert arena.lease(1000) is None  # two lent: fresh memory
    del held, joins
    bigger = arena.lease(50_000)  # both free, both too small: one replaced
    assert bigger is not None and bigger.size >= 50_000
    assert len(arena.regions) == 2
    monkeypatch.setenv(STITCH_REGIONS, "0")
    assert row_arena.Arena().lease(1000) is None
    monkeypatch.setenv(STITCH_REGIONS, "four")  # a typo is no default
    with pytest.raises(UsageError, match="SPECSHIM_STITCH_REGIONS=four: give"):
        row_arena.Arena().lease(1000)


def _inside(tensor: torch.Tensor, arena: row_arena.Arena) -> bool:
    """Whether ``tensor``'s rows lie in one of ``arena``'s regions."""
    import numpy as np

    for region in arena.regions:
        base = np.frombuffer(region.mapping, dtype=np.uint8)
        start = base.ctypes.data
        del base
        if start <= tensor.data_ptr() < start + region.size:
            return True
    return False


def _call(rng: random.Random, prompt: list[int], layers: int = 2):
    """A call of 3 sequences served ``prompt``'s blocks from the store, and
    each one's expected rows."""
    seqs, tails = [], []
    for _ in range(3):
        tail = [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
        seqs.append(prompt + tail)
        tails.append([torch.randn(len(tail), 6) for _ in range(layers)])
    at, found = 0, []
    for tail in tails:
        found.append((at, at + tail[0].shape[0], len(prompt)))
        at += tail[0].shape[0]
    return seqs, Capture([list(t) for t in tails]), found, tails


def test_held_results_stay_intact_over_many_calls_and_free_regions_are_reused(
    monkeypatch,
):
    """Every call's results held while more calls than regions are stitched
    (the later ones join into fresh memory), then let go: the next calls take
    the regions again, and nothing anyone held changed."""
    monkeypatch.setattr(row_arena, "_ARENA", [])  # this test's own
    rng = random.Random(5)
    prompt = [rng.randrange(1000) for _ in range(2 * B)]
    kept = [torch.randn(len(prompt), 6) for _ in range(2)]
    store = PrefixRows(1 << 20)
    store.offer(prompt, kept, B)
    held, expected = [], []
    for _ in range(row_arena.regions() + 3):
        seqs, capture, found, tails = _call(rng, prompt)
        out = stitch(seqs, capture, found, B, store, [chain(s, B) for s in seqs])
        held.append(out)
        expected.append([[torch.cat([kept[n], t[n]]) for n in range(2)] for t in tails])
        for states in out:  # writing into one's own rows is the caller's right
            states[0][-1].fill_(7.0)
        for want in expected[-1]:
            want[0][-1].fill_(7.0)
    for got, want in zip(held, expected, strict=True):
        for g, w in zip(got, want, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(g, w, strict=True))
    arena = row_arena.arena()
    where = [[_inside(states[0], arena) for states in out] for out in held]
    count = row_arena.regions()
    assert where == [[True] * 3] * count + [[False] * 3] * 3  # then fresh memory
    del held, out, states
    seqs, capture, found, tails = _call(rng, prompt)
    again = stitch(seqs, capture, found, B, store)
    assert all(_inside(states[0], arena) for states in again)  # a region again
    assert len(arena.regions) == count
    for states, tail in zip(again, tails, strict=True):
        assert torch.equal(states[1], torch.cat([kept[1], tail[1]]))


def test_a_closed_generator_leaves_no_free_region_mapped(monkeypatch):
    """Closing a generator unmaps the free regions; one a caller still holds
    stays (its tensors read it) and is unmapped at the next close."""
    from specshim._closing import workers_gone

    monkeypatch.setattr(row_arena, "_ARENA", [])
    arena = row_arena.arena()
    held = arena.lease(1000)
    free = arena.lease(1000)
    assert held is not None and free is not None
    rows = held.empty(10, _like())
    rows.fill_(3.0)
    del held, free
    assert len(arena.regions) == 2
    workers_gone([])
    assert len(arena.regions) == 1 and arena.regions[0].lent
    assert torch.equal(rows, torch.full((10, 8), 3.0, dtype=torch.bfloat16))
    del rows
    workers_gone([])
    assert not arena.regions


def test_a_forked_childs_writes_never_reach_rows_handed_out_here():
    """The regions are private: a child forked while a caller holds rows
    (a DataLoader worker, multiprocessing) writes its own copy."""
    arena = row_arena.Arena()
    joins = arena.lease(4096)
    assert joins is not None
    rows = joins.empty(16, _like())
    rows.fill_(1.0)
    pid = os.fork()
    if pid == 0:  # the child: write everything it can reach, then leave
        try:
            rows.fill_(2.0)
            again = arena.lease(4096)
            if again is not None:
                again.empty(16, _like()).fill_(2.0)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0
    assert torch.equal(rows, torch.ones(16, 8, dtype=torch.bfloat16))
