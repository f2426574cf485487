"""A sample served a prefix handed to extract's writer as its pieces
(``specshim/_joined.py``, ``PrefixRows.pieces``): the same rows as the
joined tensors, nothing copied on the way, and the file written from the
pieces is torch.save's of the joined tensors, byte for byte."""

from __future__ import annotations

import collections
import gc
import pickle
import random

import pytest
import torch

from specshim._joined import Joined, alone, joined_tensors
from specshim._prefix_reuse import PrefixRows, chain
from specshim.job.extract import torch_file
from specshim.patches._transport.prefix_rows import Capture, keep, stitch

from .test_prefix_rows import B, cut, random_call

Pair = collections.namedtuple("Pair", "x y")  # pickled by name: module-level


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(torch_file, "_FALLBACK", [])
    monkeypatch.setattr(torch_file, "_CHECKED", set())
    monkeypatch.setattr(torch_file, "_LAYOUTS", {})


def _pieces(rng: random.Random, rows: int, width: int) -> tuple[list, torch.Tensor]:
    """``rows`` rows cut into random pieces: some views of one storage (in
    order, so some merge), some of storages of their own, some empty."""
    whole = torch.randn(rows, width).to(torch.bfloat16)
    parts, at = [], 0
    while at < rows:
        n = rng.randrange(0, 9)
        piece = whole[at : at + n]
        parts.append(piece.clone() if rng.random() < 0.4 else piece)
        at += n
    return parts, whole


def test_a_joined_reads_as_its_joined_tensor():
    """Shape, spans and copies of a Joined, over random pieces and cuts."""
    rng = random.Random(0)
    for _ in range(200):
        parts, whole = _pieces(rng, rng.randrange(1, 40), 3)
        joined = Joined(parts)
        assert joined.shape == tuple(whole.shape) and joined.dtype == whole.dtype
        assert torch.equal(joined.tensor(), whole)
        a = rng.randrange(0, whole.shape[0] + 1)
        b = rng.randrange(a, whole.shape[0] + 1)
        span = joined[a:b]
        assert span.shape == tuple(whole[a:b].shape)
        assert torch.equal(span.tensor(), whole[a:b])
        copy = span.clone()
        assert torch.equal(copy, whole[a:b]) and alone(copy)
        assert all(
            copy.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
            for p in span.parts
        )
        assert alone(span.tensor())
        assert span.numel() * span.element_size() == whole[a:b].nbytes
    with pytest.raises(ValueError, match="pieces of rows"):
        Joined([torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(TypeError, match="never pickled"):
        pickle.dumps(Joined([torch.zeros(2, 3)]))


def _both_ways(seed: int):
    """``random_call(seed)`` stitched by a store of tensors and by one of
    pieces (the call's captures gone after): its sequences, both results,
    both stores, and the bytes the pieces' stitch copied. None where
    nothing ran."""
    call = random_call(seed)
    if call is None:
        return None
    seqs, stacked, found, (plain, pieced) = call
    pieced.pieces = True
    lengths = [len(s) for s in seqs]
    want = stitch(seqs, Capture(cut(stacked, lengths)), found, B, plain)
    before = pieced.copied_bytes
    got = stitch(seqs, Capture(cut(stacked, lengths)), found, B, pieced)
    return seqs, want, got, (plain, pieced), pieced.copied_bytes - before


def test_stitching_into_pieces_gives_the_joined_rows_and_copies_nothing():
    """Over random calls of sharers, a store that asks for pieces gets, row
    for row, what the tensor path returns, with no byte copied to put served
    rows back; and keeping blocks from those pieces keeps the same rows."""
    checked = 0
    for seed in range(200):
        both = _both_ways(seed)
        if both is None:
            continue
        seqs, want, got, (plain, pieced), copied = both
        assert copied == 0, seed  # no join, no owned copy
        for x, y in zip(want, got, strict=True):
            assert (x is None) == (y is None), seed
            for u, v in zip(x or [], y or [], strict=True):
                v = v.tensor() if isinstance(v, Joined) else v
                assert torch.equal(u, v), seed
                checked += 1
        if all(x is not None for x in got):
            chains = [chain(s, B) for s in seqs]
            keep(seqs, want, B, plain, chains)
            keep(seqs, got, B, pieced, chains)
            assert plain.blocks.keys() == pieced.blocks.keys(), seed
            for block, rows in plain.blocks.items():
                for u, v in zip(rows, pieced.blocks[block], strict=True):
                    assert torch.equal(u, v), seed
    assert checked > 500


def test_a_file_written_from_pieces_is_torch_saves_of_the_joined_rows(tmp_path):
    """The first file of its shape (checked against torch.save in memory) and
    the ones after it (not checked as they are written) are torch.save's
    bytes of the joined sample; no fallback taken."""
    rng = random.Random(1)
    for n in range(12):
        states = []
        for _ in range(3):
            parts, _ = _pieces(rng, rng.randrange(1, 60), 16)
            states.append(Joined(parts))
        states[rng.randrange(3)] = torch.randn(7, 16).to(torch.bfloat16)  # a tensor
        tokens = states[0].shape[0]
        data = {
            "input_ids": torch.arange(tokens),
            "hidden_states": states,
            "loss_mask": torch.ones(tokens, dtype=torch.long),
        }
        want, got = _written(tmp_path, f"data_{n}.pt", data)
        assert got == want
        loaded = torch.load(tmp_path / "got" / f"data_{n}.pt")
        for u, v in zip(loaded["hidden_states"], states, strict=True):
            assert torch.equal(u, v.tensor() if isinstance(v, Joined) else v)
    assert not torch_file._FALLBACK
    assert torch_file._CHECKED == {(5, True)}


def test_a_piece_off_the_cpu_or_not_packed_sends_the_file_to_torch_save(tmp_path):
    """A piece the writer cannot read as its bytes: that file alone goes
    through torch.save of the joined tensors, the next is written again."""
    whole = torch.randn(6, 4)
    strided = torch.randn(4, 6).t()  # rows of another stride: not packed
    data = {"hidden_states": [Joined([strided[:3], whole[:2]])]}
    want, got = _written(tmp_path, "data_0.pt", data)
    assert got == want
    assert not torch_file._FALLBACK and not torch_file._CHECKED
    data = {"hidden_states": [Joined([whole[3:], whole[:2]])]}
    want, got = _written(tmp_path, "data_1.pt", data)
    assert got == want
    assert torch_file._CHECKED == {(1, True)}


def _written(where, name: str, data: dict) -> tuple[bytes, bytes]:
    """torch.save's bytes of ``data`` joined, and torch_file's of ``data``,
    each written under ``name`` (the archive's folder inside is the name)."""
    (where / "want").mkdir(exist_ok=True)
    (where / "got").mkdir(exist_ok=True)
    torch.save(joined_tensors(data), where / "want" / name)
    torch_file.save(data, where / "got" / name)
    return (where / "want" / name).read_bytes(), (where / "got" / name).read_bytes()


def test_odd_pieces_and_containers_are_written_as_torch_save_writes_them(tmp_path):
    """Every file here is written after the first of its shape (so not
    compared as it is written) and must still be torch.save's bytes: a
    Joined that is one tensor's whole storage with an odd stride, one of no
    rows, one of more than 1024 pieces (writev's limit), and containers
    torch.save keeps as they are (an OrderedDict, a namedtuple, a list
    referred to twice)."""
    whole = torch.randn(3000, 2)
    first = {"hidden_states": [Joined([whole[:3], whole[5:9]])]}
    want, got = _written(tmp_path, "data_0.pt", first)
    assert got == want and torch_file._CHECKED == {(1, True)}
    odd = torch.randn(1, 2).as_strided((1, 2), (8, 1))  # one row, stride 8
    assert alone(odd)
    many = Joined([whole[i : i + 1] for i in range(0, 3000, 2)])  # 1,500 pieces
    assert len(many.parts) == 1500
    shared = [Joined([whole[:1], whole[9:10]])]
    samples = [
        {"hidden_states": [Joined([odd])]},
        {"hidden_states": [Joined([whole[4:4]])]},
        {"hidden_states": [many]},
        collections.OrderedDict(hidden_states=[Joined([whole[:2], whole[7:8]])]),
        {"hidden_states": [Pair(Joined([whole[:2], whole[6:7]]), 1)]},
        {"hidden_states": shared, "again": shared},
    ]
    for n, data in enumerate(samples, 1):
        want, got = _written(tmp_path, f"data_{n}.pt", data)
        assert got == want, n
    # No Joined at all: torch.save's bytes of the object itself, its
    # containers untouched (a list referred to twice is stored once).
    plain = [torch.randn(2, 2)]
    data = collections.OrderedDict(a=plain, b=plain, c=Pair(plain, 2))
    assert joined_tensors(data) is data
    torch.save(data, tmp_path / "want" / "data_9.pt")
    torch_file.save(data, tmp_path / "got" / "data_9.pt")
    want = (tmp_path / "want" / "data_9.pt").read_bytes()
    assert (tmp_path / "got" / "data_9.pt").read_bytes() == want
    assert not torch_file._FALLBACK


def test_pieces_outlive_what_made_them(tmp_path):
    """A served sample's pieces are views of the call's captured pieces and
    of blocks the store keeps: once the capture is gone and the store has
    dropped those blocks (the plan's last use), memory taken afterwards
    never lands in them; the file written then holds the rows as joined
    before."""
    for seed in range(40):
        both = _both_ways(seed)
        if both is None:
            continue
        seqs, want, got, (_, pieced), _ = both
        for ids in seqs:  # the store lets go of every block
            pieced.done(ids, B)
        pieced.blocks.clear()
        gc.collect()
        junk = [torch.full((64, 3), float("nan")) for _ in range(200)]
        for n, (x, y) in enumerate(zip(want, got, strict=True)):
            if y is None:
                continue
            data = {"hidden_states": y}
            torch_file.save(data, tmp_path / f"s{seed}_{n}.pt")
            loaded = torch.load(tmp_path / f"s{seed}_{n}.pt")["hidden_states"]
            for u, v in zip(x, loaded, strict=True):
                assert torch.equal(u, v), seed
        del junk


def test_a_run_of_blocks_in_a_sequence_of_the_call_is_read_once(monkeypatch):
    """The first sequence is served a 6-block prompt from the store, the
    others the same blocks from it: each reads the first sequence's rows
    once a layer, not once a block (a Joined is read piece by piece), and
    is two pieces: the kept prompt and its own tail."""
    rng = random.Random(5)
    prompt = [rng.randrange(1000) for _ in range(6 * B)]
    seqs = [prompt + [rng.randrange(1000) for _ in range(3 + n)] for n in range(4)]
    store = PrefixRows(1 << 20, uses={h: 9 for h in chain(prompt, B)}, pieces=True)
    kept = [torch.randn(len(prompt), 3) for _ in range(2)]
    store.offer(prompt, kept, B)
    tails = [[torch.randn(len(s) - 6 * B, 3) for _ in range(2)] for s in seqs]
    found, at = [], 0
    for s in seqs:
        found.append((at, at + len(s) - 6 * B, 6 * B))
        at += len(s) - 6 * B
    reads = []
    original = Joined.__getitem__
    monkeypatch.setattr(
        Joined,
        "__getitem__",
        lambda self, rows: reads.append(rows) or original(self, rows),
    )
    out = stitch(seqs, Capture(tails), found, B, store)
    assert len(reads) == 2 * (len(seqs) - 1)  # a layer a sequence served from it
    for states, tail in zip(out, tails, strict=True):
        for n in range(2):
            assert len(states[n].parts) == 2
            assert torch.equal(states[n].tensor(), torch.cat([kept[n], tail[n]]))


def test_a_stand_in_never_written_from_its_pieces_is_refused(tmp_path, monkeypatch):
    """Where a stand-in's storage is not found among the pieces as _save
    writes it, its own bytes (no rows at all) would be written: refused,
    and the file goes through torch.save of the joined rows instead."""
    whole = torch.randn(9, 4)
    data = {"hidden_states": [Joined([whole[:3], whole[5:9]])]}
    original = torch_file._Records.write_record

    def lost(self, name, record, size):  # the lookup misses every stand-in
        self.pieces = {}
        original(self, name, record, size)

    monkeypatch.setattr(torch_file._Records, "write_record", lost)
    want, got = _written(tmp_path, "data_0.pt", data)
    assert got == want
    assert (
        torch_file._FALLBACK
        and "not written from its pieces" in torch_file._FALLBACK[0]
    )
