"""Rows vLLM's prefix cache served, put back in front of the rows it computed
(``specshim._prefix_reuse`` says why that is sound and keeps the earlier
calls' rows).

``stitch`` completes each sequence of a call: its tail from the capture, each
served block from a sequence of the same call that computed it, else from the
store. A sequence with a block found nowhere is left for the caller to compute
whole (with a cache salt of its own, so nothing is served). Nothing is
guessed: a block's rows are used only under the hash of every token before its
end. A store that asks for pieces (``extract``'s) gets a sequence served rows
as a ``Joined`` per layer, its pieces uncopied (``specshim._joined``).
"""

from __future__ import annotations

import bisect
import contextlib
import resource
import time
from collections.abc import Hashable, Iterator, Sequence
from typing import Any

from specshim._joined import Joined, alone, merged
from specshim._prefix_reuse import PrefixRows, chain
from specshim.patches._transport.threads import lent_threads


def stitch(
    sequences: list[Sequence[int]],
    capture: Capture,
    found: list[tuple[int, int, int] | None],
    block_size: int,
    store: PrefixRows,
    chains: list[list[Hashable]] | None = None,
) -> list[list[Any] | None]:
    """Each sequence's rows, one tensor per layer, or None where a served block
    is found nowhere (or no run was proven for it): computed whole by the caller.

    ``capture``: the call's captured rows; ``found``: ``match_tails``' runs,
    ``(start, end, k)``; ``chains``: each sequence's ``chain``, where the
    caller has them. A sequence of whole blocks with no run of its own
    (its rows read as the start of a longer sequence's run, which continued
    it in the same forward) is complete from its blocks alone. Each captured
    row is copied at most once into the sequence that ran it (a sequence
    served nothing whose run is a whole piece of the capture is that piece);
    rows of a shared block are copied again into each sequence served it, and
    into the store.
    """
    store.bind(capture.layers)
    with accounted(store, "stitch_seconds"):
        complete = _stitch(sequences, capture, found, block_size, store, chains)
    store.copied_bytes += capture.copied
    return complete


def _stitch(
    sequences: list[Sequence[int]],
    capture: Capture,
    found: list[tuple[int, int, int] | None],
    block_size: int,
    store: PrefixRows,
    chains: list[list[Hashable]] | None,
) -> list[list[Any] | None]:
    call = _Call(
        sequences, block_size, store, chains, _joins(sequences, capture, found, store)
    )
    # A served block was computed by a sequence served less: fewest first.
    ran = [i for i, run in enumerate(found) if run is not None]
    for i in sorted(ran, key=lambda i: found[i][2]):  # type: ignore[index]
        start, end, k = found[i]  # type: ignore[misc]
        if k == 0:
            rows = capture.owned(start, end, join=not store.pieces)
            call.done(i, [], rows, 0, end - start)
            continue
        heads = call.blocks(i, k // block_size)
        if heads is not None:
            call.done(i, heads, capture.views(start, end), k, end - start)
    for i, ids in enumerate(sequences):
        if call.out[i] is None and found[i] is None and len(ids) % block_size == 0:
            heads = call.blocks(i, len(ids) // block_size)
            if heads is not None:
                call.done(i, heads, [[] for _ in capture.layers], len(ids), 0)
    return call.out


def _joins(
    sequences: list[Sequence[int]],
    capture: Capture,
    found: list[tuple[int, int, int] | None],
    store: PrefixRows,
) -> Any:
    """Room in ``row_arena`` for the rows of every sequence that may be
    joined (served any block), or None (joins into fresh memory, or none:
    ``store.pieces``)."""
    from specshim.patches._transport.row_arena import ALIGN, arena

    if not capture.layers or store.pieces:
        return None
    joined = [
        len(ids)
        for ids, run in zip(sequences, found, strict=True)
        if run is None or run[2] > 0
    ]
    if not joined:
        return None
    row = sum(_nbytes(layer[:1]) for layer in capture.layers)
    slack = ALIGN * len(capture.layers) * len(joined)
    return arena().lease(sum(joined) * row + slack)


def keep(
    sequences: list[Sequence[int]],
    complete: list[list[Any]],
    block_size: int,
    store: PrefixRows,
    chains: list[list[Hashable]],
) -> None:
    """A call's sequences are complete: each is one use fewer of the blocks it
    shares, then the store keeps the blocks still wanted (copied on the
    threads vLLM leaves this process none of)."""
    for ids, hashes in zip(sequences, chains, strict=True):
        store.done(ids, block_size, hashes)
    with lent_threads(), accounted(store, "keep_seconds"):
        for ids, states, hashes in zip(sequences, complete, chains, strict=True):
            store.offer(ids, states, block_size, hashes)


@contextlib.contextmanager
def accounted(store: PrefixRows, seconds: str) -> Iterator[None]:
    """Add the block's time to ``store``'s counter ``seconds``, and the page
    faults this process took meanwhile to ``store.faults`` (the copies'
    threads are this process's: their faults count, the workers' do not)."""
    faults = _faults()
    started = time.perf_counter()
    try:
        yield
    finally:
        setattr(store, seconds, getattr(store, seconds) + time.perf_counter() - started)
        store.faults += _faults() - faults


def _faults() -> int:
    """This process's page faults so far (minor and major)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


class _Call:
    """One call's sequences as they are completed, and where each block's rows
    are: in a sequence of the call, else in the store."""

    def __init__(
        self,
        sequences: list[Sequence[int]],
        block_size: int,
        store: PrefixRows,
        chains: list[list[Hashable]] | None,
        joins: Any = None,
    ) -> None:
        self.block, self.store, self.joins = block_size, store, joins
        self.chains = chains or [chain(ids, block_size) for ids in sequences]
        self.out: list[list[Any] | None] = [None] * len(sequences)
        self.here: dict[Hashable, tuple[int, int]] = {}  # block -> (sequence, j)

    def blocks(self, i: int, count: int) -> list[list[Any]] | None:
        """The rows of sequence i's first ``count`` blocks, or None: a view
        per layer for each run of blocks that lie one after another in a
        sequence of the call (read once, however many blocks it has: a
        ``Joined`` is read piece by piece), and each block's kept rows."""
        rows: list[list[Any]] = []
        run: list[int] | None = None  # [owner, first block, blocks]
        for block in self.chains[i][:count]:
            if block in self.here:
                owner, at = self.here[block]
                if run is not None and run[0] == owner and run[1] + run[2] == at:
                    run[2] += 1
                    continue
                self._read(run, rows)
                run = [owner, at, 1]
                continue
            self._read(run, rows)
            run = None
            if (kept := self.store.get(block)) is None:
                return None
            rows.append(kept)
        self._read(run, rows)
        return rows

    def _read(self, run: list[int] | None, rows: list[list[Any]]) -> None:
        if run is None:
            return
        owner, at, blocks = run
        states = self.out[owner]
        assert states is not None
        span = slice(at * self.block, (at + blocks) * self.block)
        rows.append([h[span] for h in states])

    def done(
        self, i: int, heads: list[list[Any]], tail: list[Any], served: int, ran: int
    ) -> None:
        """Sequence i is its served blocks' rows, then ``tail``: with heads, a
        view per layer (or the views of the pieces it spans), joined once
        (``_join``); without, storage of its own already (``Capture.owned``),
        or a ``Joined`` of views where the store asks for pieces."""

        if heads:
            tail = [
                self._join([*(head[n] for head in heads), *parts])
                for n, parts in enumerate(tail)
            ]
        self.out[i] = tail
        self.store.served_tokens += served
        self.store.computed_tokens += ran
        for j, block in enumerate(self.chains[i]):
            self.here.setdefault(block, (i, j))

    def _join(self, parts: list[Any]) -> Any:
        """``parts`` one after another: as they lie, uncopied, where the store
        asks for pieces; else copied into the call's room in the arena where
        it has some left, else into fresh memory (the bytes counted)."""
        import torch

        if self.store.pieces:
            return Joined(parts)
        parts = merged(parts)
        rows = sum(part.shape[0] for part in parts)
        out = None if self.joins is None else self.joins.empty(rows, parts[0])
        joined = torch.cat(parts) if out is None else torch.cat(parts, out=out)
        self.store.copied_bytes += _nbytes(joined)
        return joined


class Capture:
    """A call's captured rows in capture order, as speculators cut them: one
    piece a sequence, one tensor a layer. Read by runs without first
    stacking them: a run that is exactly a piece, and a piece that is
    storage of its own, is that piece (no copy); any other is copied once,
    out of the pieces it spans. speculators 0.3.0 clones every piece
    (``h[a:b].clone().cpu()``; with ``state-transport`` the clone takes the
    slab's rows, which the caller then holds alone), so a piece is its own
    storage; ``owned`` checks rather than assumes it.

    speculators cuts by each sequence's length in tokens, so once the cache
    has served a sequence's first rows the pieces no longer fall on the
    runs; with nothing served (and the workers' rows in input order) every
    run is a piece."""

    def __init__(self, pieces: list[list[Any]]) -> None:
        self.pieces = [p for p in pieces if p and p[0].shape[0]]
        self.layers = self.pieces[0] if self.pieces else (pieces[0] if pieces else [])
        self.starts: list[int] = []
        total = 0
        for piece in self.pieces:
            self.starts.append(total)
            total += piece[0].shape[0]
        self.rows = total
        self.copied = 0  # bytes ``owned`` copied

    def views(self, start: int, end: int) -> list[list[Any]]:
        """Rows ``[start, end)``: per layer, views of the pieces they span."""
        out: list[list[Any]] = [[] for _ in self.layers]
        at = max(bisect.bisect_right(self.starts, start) - 1, 0)
        while start < end and at < len(self.pieces):
            first = self.starts[at]
            stop = min(end, first + self.pieces[at][0].shape[0])
            if stop > start:
                for n, layer in enumerate(self.pieces[at]):
                    out[n].append(layer[start - first : stop - first])
                start = stop
            at += 1
        if start < end:
            raise ValueError(f"rows {start} to {end} of {self.rows} captured")
        return out

    def owned(self, start: int, end: int, join: bool = True) -> list[Any]:
        """Rows ``[start, end)`` per layer in storage of their own: the piece
        itself where the run is one, else a copy (a view would carry the
        whole piece along: torch.save writes a view's whole storage), or,
        ``join`` false, a ``Joined`` of the views."""
        at = bisect.bisect_left(self.starts, start)
        if (
            at < len(self.pieces)
            and self.starts[at] == start
            and self.pieces[at][0].shape[0] == end - start
            and all(map(alone, self.pieces[at]))
        ):
            return list(self.pieces[at])
        if not join:
            return [Joined(parts) for parts in self.views(start, end)]
        import torch

        rows = [
            parts[0].clone() if len(parts) == 1 else torch.cat(parts)
            for parts in self.views(start, end)
        ]
        self.copied += sum(map(_nbytes, rows))
        return rows


def _nbytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size()
